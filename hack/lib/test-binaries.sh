# Sourced by hack/test and hack/testhost-soak.
#
# test_binaries [--except] PKG... : the test executables of the workspace
# packages named (with --except: of every other workspace package), one
# "PACKAGE_DIR EXECUTABLE" a line. Always built as `cargo test --workspace
# --no-run`: the same packages as hack/test's `cargo build --workspace
# --all-targets`, so the same features are unified and nothing is compiled
# a second time (a `-p` or `--exclude` selection unifies other features and
# rebuilt most of the workspace, twice, about 5 minutes of every run).
test_binaries() {
    cargo test --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, os, sys
args = sys.argv[1:]
except_ = bool(args) and args[0] == "--except"
names = set(args[1:] if except_ else args)
def package_name(pid):
    # "path+file:///w/vmm#burrow-vmm@0.1.0", or "...#0.1.0" when the
    # directory is named like the package, or the old "name 0.1.0 (...)".
    if "#" in pid:
        frag = pid.split("#", 1)[1]
        if "@" in frag:
            return frag.split("@", 1)[0]
        return pid.split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return pid.split(" ", 1)[0]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("profile", {}).get("test") or not m.get("executable"):
        continue
    if (package_name(m.get("package_id", "")) in names) != except_:
        print(os.path.dirname(m["manifest_path"]), m["executable"])
' "$@"
}
