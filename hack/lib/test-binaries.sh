# Sourced by hack/test and hack/testhost-soak.
# test_binaries ARGS...: the test executables `cargo test ARGS --no-run`
# builds (ARGS: cargo's package flags), one path a line.
test_binaries() {
    cargo test "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
'
}
