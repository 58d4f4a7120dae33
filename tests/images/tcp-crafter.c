/* tcp-crafter: send hand-made TCP segments from a raw socket, as root in a
 * hostile guest could: net_cni's egress test sends non-SYN segments with a
 * payload, which a stateless filter that drops only SYNs would let out.
 * Static (tests/images/tcp-crafter builds it), for the busybox image.
 *
 * usage: tcp-crafter DST DPORT SPORT FLAGS COUNT PAYLOAD
 *   FLAGS: letters of S (syn) A (ack) P (psh) F (fin) R (rst).
 * The source address is the one the routes pick for DST. Exits 0 once
 * COUNT segments (100 ms apart) are sent. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static unsigned short csum(const void *data, size_t len, unsigned long sum) {
    const unsigned char *p = data;
    for (; len > 1; p += 2, len -= 2)
        sum += (unsigned long)p[0] << 8 | p[1];
    if (len)
        sum += (unsigned long)p[0] << 8;
    while (sum >> 16)
        sum = (sum & 0xffff) + (sum >> 16);
    return (unsigned short)~sum;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: tcp-crafter DST DPORT SPORT FLAGS COUNT PAYLOAD\n");
        return 2;
    }
    struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &dst.sin_addr) != 1) {
        fprintf(stderr, "tcp-crafter: bad address %s\n", argv[1]);
        return 2;
    }
    /* The source address: the one a connected UDP socket is given. */
    struct sockaddr_in src;
    socklen_t slen = sizeof src;
    int u = socket(AF_INET, SOCK_DGRAM, 0);
    if (u < 0 || connect(u, (struct sockaddr *)&dst, sizeof dst) < 0 ||
        getsockname(u, (struct sockaddr *)&src, &slen) < 0) {
        perror("tcp-crafter: source address");
        return 1;
    }
    close(u);
    int s = socket(AF_INET, SOCK_RAW, IPPROTO_RAW);
    if (s < 0) {
        perror("tcp-crafter: raw socket");
        return 1;
    }
    const char *payload = argv[6];
    size_t plen = strlen(payload);
    unsigned char pkt[1400];
    if (plen > sizeof pkt - 40)
        plen = sizeof pkt - 40;
    int count = atoi(argv[5]);
    for (int i = 0; i < count; i++) {
        memset(pkt, 0, sizeof pkt);
        struct iphdr *ip = (struct iphdr *)pkt;
        struct tcphdr *tcp = (struct tcphdr *)(pkt + 20);
        ip->version = 4;
        ip->ihl = 5;
        ip->ttl = 64;
        ip->protocol = IPPROTO_TCP;
        ip->tot_len = htons(40 + plen);
        ip->id = htons(0x4242 + i);
        ip->saddr = src.sin_addr.s_addr;
        ip->daddr = dst.sin_addr.s_addr;
        tcp->source = htons(atoi(argv[3]));
        tcp->dest = dst.sin_port;
        tcp->seq = htonl(1000000 + i * plen);
        tcp->ack_seq = htonl(2000000);
        tcp->doff = 5;
        tcp->window = htons(65535);
        for (const char *f = argv[4]; *f; f++) {
            switch (*f) {
            case 'S': tcp->syn = 1; break;
            case 'A': tcp->ack = 1; break;
            case 'P': tcp->psh = 1; break;
            case 'F': tcp->fin = 1; break;
            case 'R': tcp->rst = 1; break;
            default: fprintf(stderr, "tcp-crafter: flag %c\n", *f); return 2;
            }
        }
        memcpy(pkt + 40, payload, plen);
        /* The pseudo-header's sum, then the segment's. */
        unsigned long sum = 0;
        const unsigned char *a = (const unsigned char *)&ip->saddr;
        for (int k = 0; k < 8; k += 2)
            sum += (unsigned long)a[k] << 8 | a[k + 1];
        sum += IPPROTO_TCP + 20 + plen;
        tcp->check = htons(csum(tcp, 20 + plen, sum));
        ip->check = htons(csum(ip, 20, 0));
        if (sendto(s, pkt, 40 + plen, 0, (struct sockaddr *)&dst, sizeof dst) < 0) {
            perror("tcp-crafter: sendto");
            return 1;
        }
        usleep(100000);
    }
    printf("tcp-crafter: sent %d segments %s -> %s:%s flags %s\n", count,
           inet_ntoa(src.sin_addr), argv[1], argv[2], argv[4]);
    return 0;
}
