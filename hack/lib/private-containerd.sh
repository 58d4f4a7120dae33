# Sourced by hack/demo and bench/runtimes: start a private containerd (own
# socket, root and state under $work) with burrow's shim reachable, import
# the locally built busybox image, and define `ctr` to talk to it.
# Needs: $here (repo root), $work (scratch dir, removed by the caller);
# optional $containerd_log_level (default warn).
# Sets: $containerd_pid; registers private_containerd_stop on EXIT.

source "$here/hack/lib/burrow-binaries.sh"
# burrow's config: $BURROW_CONFIG when set; with installed binaries the
# installed /etc/burrow/config.toml; else one written here for this
# checkout's cached guest kernel and initramfs.
if [[ -n ${BURROW_CONFIG:-} ]]; then
    echo "burrow config: $BURROW_CONFIG (BURROW_CONFIG)" >&2
elif [[ $burrow_bin_from == installed* && -f /etc/burrow/config.toml ]]; then
    echo "burrow config: /etc/burrow/config.toml (installed)" >&2
else
    printf 'kernel = "%s"\ninitrd = "%s"\nstate_dir = "%s"\ntemplate_dir = "%s"\nlayer_cache_dir = "%s"\n[memory_mib]\ndefault = 256\n' \
        "$("$here/guest-kernel/build" | tail -n 1)" "$("$here/rootfs/build" "${agent_profile[@]}" | tail -n 1)" "$work/burrow" "$work/templates" "$work/layers" >"$work/burrow.toml"
    export BURROW_CONFIG=$work/burrow.toml
    echo "burrow config: this checkout's cached guest kernel and ${agent_profile[*]:-debug} agent initramfs ($BURROW_CONFIG)" >&2
fi
croot=/var/lib/containerd/private-$$
mkdir -p "$croot"
printf 'version = 2\nroot = "%s"\nstate = "%s"\n[grpc]\n  address = "%s"\n' \
    "$croot" "$work/state" "$work/containerd.sock" >"$work/containerd.toml"
containerd --config "$work/containerd.toml" --log-level "${containerd_log_level:-warn}" >"$work/containerd.log" 2>&1 &
containerd_pid=$!
private_containerd_stop() {
    kill "$containerd_pid" 2>/dev/null || true
    wait "$containerd_pid" 2>/dev/null || true
    grep -o " $croot[^ ]*" /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$work" "$croot"
}
trap private_containerd_stop EXIT
ctr() { command ctr --address "$work/containerd.sock" "$@"; }
for _ in $(seq 100); do [[ -S $work/containerd.sock ]] && break; sleep 0.2; done
ctr images import "$("$here/tests/images/busybox")" >/dev/null
