"""Split each timed `ctr run --rm` of bench/runtimes into phases.

Usage: runtime-phases.py MARKS CONTAINERD_LOG

MARKS has one line per timed run: `bench-RUNTIME-N T0 T1` (epoch seconds).
CONTAINERD_LOG is the private containerd's log at debug level, with the
shims' own lines in it. Prints three markdown tables (medians, in ms):

0. burrow's creates, from the shim's `created` line of each run.
1. every runtime, split at the events containerd logs ("event published"
   for its own, "event forwarded" for a shim's): ctr until the container
   record exists (image, snapshot, record), the task's create (the shim's
   start included), its start, the run until the exit event, the delete,
   and after it (the shim's shutdown, the container's and snapshot's
   removal, ctr's exit). The same cut for runc and burrow.
2. burrow's runs, split at the shim's own timestamped lines, which tell
   the create itself from what comes before it and the sandbox's shutdown
   from the rest.
"""
import re
import statistics
import sys
from datetime import datetime


def ts(text):
    m = re.match(r'(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)', text)
    if not m:
        return None
    frac = float(m.group(2) or 0)
    tz = '+00:00' if m.group(3) == 'Z' else m.group(3)
    return datetime.fromisoformat(m.group(1) + tz).timestamp() + frac


def read_log(path):
    """(time, message, topic or None) for every timestamped line."""
    events = []
    for line in open(path, errors='replace'):
        # The shim's lines reach the log beside containerd's own, and two
        # may be interleaved (`time="time="2026-...` on one line, the
        # other's `2026-..." level=` starting the next).
        if re.match(r'\d{4}-\d\d-\d\dT[^"]*"', line):
            line = 'time="' + line
        stamps = re.findall(r'time="(\d{4}-[^"]+)"', line)
        t = stamps[-1] if stamps else None
        when = ts(t) if t else None
        if t:
            line = line[line.rindex(t):]
        msg = re.search(r'msg="([^"]*)', line)
        if when is not None and msg:
            topic = re.search(r' topic=(\S+)', line)
            events.append((when, msg.group(1), topic.group(1) if topic else None))
    return events


def read_marks(path):
    for mark in open(path):
        name, t0, t1 = mark.split()
        yield name, name.rsplit('-', 1)[0][len('bench-'):], float(t0), float(t1)


def table(header, rows):
    print()
    print('| runtime | ' + ' | '.join(header) + ' |')
    print('| --- | ' + ' | '.join('---' for _ in header) + ' |')
    for rt, runs in rows.items():
        cols = [round(statistics.median(c) * 1000) for c in zip(*runs)]
        print(f'| {rt} | ' + ' | '.join(str(c) for c in cols) + f' | {len(runs)} |')


def by_events(marks, events):
    topics = ['/containers/create', '/tasks/create', '/tasks/start', '/tasks/exit', '/tasks/delete']
    rows = {}
    for name, rt, t0, t1 in marks:
        seen = {}
        for t, m, topic in events:
            if t0 <= t <= t1 and m in ('event published', 'event forwarded') and topic in topics:
                seen.setdefault(topic, t)
        if len(seen) != len(topics):
            missing = [t for t in topics if t not in seen]
            print(f'{name}: no {", ".join(missing)} event in containerd\'s log', file=sys.stderr)
            continue
        at = [t0] + [seen[t] for t in topics] + [t1]
        rows.setdefault(rt, []).append([b - a for a, b in zip(at, at[1:])] + [t1 - t0])
    if rows:
        table(['ctr to the container record', 'task create', 'start', 'run until exit',
               'delete', 'after', 'whole (ms)', 'runs'], rows)


def by_create_line(marks, events):
    """burrow's creates, from the shim's `created` line of each run: the
    create, its root filesystem, the VM to an answering agent, and the
    guest's side (the line's first four times)."""
    rows = {}
    for name, rt, t0, t1 in marks:
        if not rt.startswith('burrow'):
            continue
        line = next((m for t, m, _ in events if t0 <= t <= t1 and m.startswith(f'{name}: created')), None)
        times = [int(ms) / 1000 for ms in re.findall(r'(\d+) ms', line or '')[:4]]
        if len(times) < 4:
            print(f'{name}: no phase line in containerd\'s log', file=sys.stderr)
            continue
        rows.setdefault(rt, []).append(times)
    if rows:
        table(['create, median (ms)', 'root filesystem (ms)', 'VM to agent ready (ms)',
               'identity and container in the guest (ms)', 'starts'], rows)


def by_shim_lines(marks, events):
    rows = {}
    for name, rt, t0, t1 in marks:
        if not rt.startswith('burrow'):
            continue
        mine = [(t, m) for t, m, _ in events if t0 <= t <= t1]

        def find(prefix):
            for t, m in mine:
                if m.startswith(prefix):
                    ms = re.search(r' in (\d+) ms', m)
                    return t, (int(ms.group(1)) / 1000 if ms else None)
            return None, None
        tc, create = find(f'{name}: created')
        ts_, start = find(f'{name}: started in')
        td, delete = find(f'{name}: deleted in')
        tx, shutdown = find('sandbox shut down in')
        if None in (tc, create, ts_, start, td, delete, tx, shutdown):
            print(f'{name}: a phase line is missing in containerd\'s log', file=sys.stderr)
            continue
        # Each column ends where the next begins, so they add up to the whole:
        # the start and shutdown columns include containerd's hand-over.
        rows.setdefault(rt, []).append(
            [tc - create - t0, create, ts_ - tc, (td - delete) - ts_, delete, tx - td, t1 - tx, t1 - t0])
    if rows:
        table(['before create', 'create', 'start', 'run until delete', 'delete', 'shutdown',
               'after', 'whole (ms)', 'runs'], rows)


def main():
    marks = list(read_marks(sys.argv[1]))
    events = read_log(sys.argv[2])
    by_create_line(marks, events)
    by_events(marks, events)
    by_shim_lines(marks, events)


main()
