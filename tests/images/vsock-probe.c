/*
 * vsock-probe: what a process in a container gets when it tries to reach
 * vsock peers. Built static (tests/images/vsock-probe) so it runs in the
 * busybox image, which has no libc.
 *
 *   vsock-probe CID:PORT...    (CID may be "self": the guest's own CID,
 *                               read from /dev/vsock if the container has it)
 *
 * Prints one line per step:
 *   socket ok | socket errno=N NAME
 *   local_cid N | local_cid errno=N NAME
 *   connect CID:PORT errno=N NAME
 *   connect CID:PORT ok, then: reply TEXT | reply eof | reply errno=N NAME
 * After a connect that succeeds it sends "ping from the container\n" and
 * prints the first line the peer answers (30 s at most).
 * Exits 0 once every step ran (the results are the output).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

static void say_errno(const char *what, int e)
{
	const char *name = strerrorname_np(e);
	printf("%s errno=%d %s\n", what, e, name ? name : "?");
}

static int open_socket(void)
{
	return socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
}

static void probe(unsigned int cid, unsigned int port)
{
	char what[64];
	snprintf(what, sizeof what, "connect %u:%u", cid, port);
	int fd = open_socket();
	if (fd < 0) {
		say_errno(what, errno);
		return;
	}
	/* The nested test host is slow: a real answer may take seconds. */
	struct timeval tv = { .tv_sec = 30 };
	setsockopt(fd, AF_VSOCK, SO_VM_SOCKETS_CONNECT_TIMEOUT, &tv, sizeof tv);
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	struct sockaddr_vm a = { .svm_family = AF_VSOCK, .svm_cid = cid, .svm_port = port };
	if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
		say_errno(what, errno);
		close(fd);
		return;
	}
	printf("%s ok\n", what);
	static const char ping[] = "ping from the container\n";
	if (send(fd, ping, sizeof ping - 1, MSG_NOSIGNAL) < 0) {
		say_errno("send", errno);
		close(fd);
		return;
	}
	char buf[256];
	size_t got = 0;
	while (got < sizeof buf - 1) {
		ssize_t n = recv(fd, buf + got, sizeof buf - 1 - got, 0);
		if (n < 0) {
			say_errno("reply", errno);
			close(fd);
			return;
		}
		if (n == 0)
			break;
		got += (size_t)n;
		if (memchr(buf, '\n', got))
			break;
	}
	close(fd);
	if (got == 0) {
		printf("reply eof\n");
		return;
	}
	buf[got] = 0;
	char *nl = strchr(buf, '\n');
	if (nl)
		*nl = 0;
	for (char *p = buf; *p; p++)
		if (*p < 0x20 || *p > 0x7e)
			*p = '?';
	printf("reply %s\n", buf);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	int fd = open_socket();
	if (fd < 0)
		say_errno("socket", errno);
	else {
		printf("socket ok\n");
		close(fd);
	}
	long self = -1;
	int dev = open("/dev/vsock", O_RDONLY | O_CLOEXEC);
	unsigned int local = 0;
	if (dev < 0)
		say_errno("local_cid", errno);
	else if (ioctl(dev, IOCTL_VM_SOCKETS_GET_LOCAL_CID, &local) < 0)
		say_errno("local_cid", errno);
	else {
		printf("local_cid %u\n", local);
		self = local;
	}
	if (dev >= 0)
		close(dev);
	for (int i = 1; i < argc; i++) {
		char *colon = strchr(argv[i], ':');
		if (!colon) {
			fprintf(stderr, "vsock-probe: %s is not CID:PORT\n", argv[i]);
			return 2;
		}
		*colon = 0;
		unsigned int port = (unsigned int)strtoul(colon + 1, NULL, 10);
		if (strcmp(argv[i], "self") == 0) {
			if (self < 0) {
				printf("connect self:%u skipped (no local CID)\n", port);
				continue;
			}
			probe((unsigned int)self, port);
		} else {
			probe((unsigned int)strtoul(argv[i], NULL, 10), port);
		}
	}
	return 0;
}
