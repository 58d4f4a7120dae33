# Sourced by hack/lib/private-containerd.sh and hack/demo: which burrow
# binaries, and which build of the guest's agent, a private containerd
# runs. hack/demo asks before it enters the test host, so it can build that
# agent out here: built inside, on the test host's software CPU, it takes
# longer than the demo's whole time limit.
# Needs: $here (repo root). Sets: $burrow_bin_from, $agent_profile (the
# rootfs/build flags) and PATH.

# burrow's binaries: this checkout's release build, else its debug build,
# else the installed ones (burrow install); said on stderr, never silently.
burrow_bin_from="" agent_profile=()
for profile in release debug; do
    if [[ -x $here/target/$profile/containerd-shim-burrow-v2 && -x $here/target/$profile/burrow-vmm ]]; then
        export PATH=$here/target/$profile:$PATH
        burrow_bin_from="this checkout's $profile build ($here/target/$profile)"
        # The guest's agent from the same profile (a debug agent is
        # several times slower in a guest: not what `burrow install` packs).
        [[ $profile == release ]] && agent_profile=(--release)
        break
    fi
done
if [[ -z $burrow_bin_from ]]; then
    command -v containerd-shim-burrow-v2 >/dev/null ||
        { echo "no burrow build in $here/target and none installed: run hack/setup (or cargo build --release)" >&2; exit 1; }
    burrow_bin_from="installed ($(dirname "$(command -v containerd-shim-burrow-v2)"))"
fi
echo "burrow binaries: $burrow_bin_from" >&2
