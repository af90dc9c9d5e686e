#!/usr/bin/env bash
# trace-overhead.sh TARGET [JOB] -- where a request's time goes. Runs one fio-suite job (default
# randread4k) on TARGET (a mounted qcowfs/qsd file, or a plain file for the baseline) and traces
# half a second in the middle of it with tracefs: io_uring submit/complete (fio's ring and the
# daemon's), fuse_request_send/end and block_rq_issue/complete. Prints, per stage, the mean time
# a request spends in it and how many requests are in it on average (Little's law):
#   fio          fio's io_uring submit -> completion (what fio measures)
#   fuse         the kernel FUSE request: queued -> reply received
#   daemon I/O   the daemon's host I/O: io_uring submit -> completion (any other io_uring user)
#   block        the disk: block_rq_issue -> block_rq_complete
# "fio - block" is the time a request spends outside the disk: FUSE, the daemon, wake-ups.
# Needs root, tracefs (mounted here if absent), fio. Env: RUNTIME (default 5).
set -euo pipefail
target=$1; job=${2:-randread4k}
here=$(cd "$(dirname "$0")" && pwd)
T=/sys/kernel/tracing
[ -e $T/trace ] || mount -t tracefs nodev $T
events="fuse/fuse_request_send fuse/fuse_request_end io_uring/io_uring_submit_req io_uring/io_uring_complete
        block/block_rq_issue block/block_rq_complete"
out=$(mktemp); trap 'echo 0 > $T/tracing_on; for e in $events; do echo 0 > $T/events/$e/enable; done; rm -f "$out"' EXIT
echo 0 > $T/tracing_on; echo > $T/trace; echo 40000 > $T/buffer_size_kb; echo mono > $T/trace_clock
for e in $events; do [ -e $T/events/$e/enable ] && echo 1 > $T/events/$e/enable; done
rt=${RUNTIME:-5}
(sleep "$(echo "$rt / 2" | bc -l)"; echo 1 > $T/tracing_on; sleep 0.5; echo 0 > $T/tracing_on) &
RUNTIME=$rt "$here/fio-suite.sh" "$target" "$(basename "$target")" "$job"
wait
cat $T/trace > "$out"
python3 - "$out" <<'PY'
import collections, re, sys
pat = re.compile(r'^\s*(.+?)-(\d+)\s+\[\d+\]\s+\S+\s+([\d.]+): (\w+): (.*)$')
ev = [(float(m.group(3)), m.group(1), m.group(4), m.group(5)) for l in open(sys.argv[1]) if (m := pat.match(l))]
if not ev: sys.exit("no events traced")
dur = ev[-1][0] - ev[0][0]
stages = collections.defaultdict(list)  # stage -> [(t, 'S'|'E', key)]
for t, comm, name, rest in ev:
    if name.startswith('fuse_request'):
        u = re.search(r'req (\d+)', rest).group(1)
        stages['fuse'].append((t, 'S' if name.endswith('send') else 'E', u))
    elif name.startswith('io_uring'):
        if 'opcode' in rest and re.search(r'opcode (POLL_ADD|URING_CMD)', rest): continue
        ud = re.search(r'user_data (\w+)', rest).group(1)
        stage = 'fio' if comm.startswith('fio') or comm.startswith('iou-') else 'daemon I/O'
        if name == 'io_uring_complete': stage = None  # completions run in any task: key by ring below
        ring = rest.split(',')[0].split()[1]
        stages[('ring', ring)].append((t, 'S' if name == 'io_uring_submit_req' else 'E', ud, stage))
    elif name.startswith('block_rq'):
        m = re.search(r' (\d+) \+ \d+', rest)
        if m: stages['block'].append((t, 'S' if name.endswith('issue') else 'E', m.group(1)))
# A ring belongs to whoever submits on it (fio or the daemon).
for key in [k for k in stages if isinstance(k, tuple)]:
    evs = stages.pop(key)
    owner = next((e[3] for e in evs if e[1] == 'S'), None)
    if owner: stages[owner] += [e[:3] for e in evs]
def latencies(evs):
    pending = collections.defaultdict(collections.deque); lat = []
    for t, kind, key in sorted(evs):
        if kind == 'S': pending[key].append(t)
        elif pending[key]: lat.append(t - pending[key].popleft())
    return lat
means = {}
print(f"{'stage':<12} {'requests/s':>10} {'mean us':>9} {'in stage':>9}")
for stage in ('fio', 'fuse', 'daemon I/O', 'block'):
    lat = latencies(stages.get(stage, []))
    if not lat: continue
    means[stage] = 1e6 * sum(lat) / len(lat)
    print(f"{stage:<12} {len(lat) / dur:>10.0f} {means[stage]:>9.1f} {sum(lat) / dur:>9.1f}")
if 'fio' in means and 'block' in means:
    print(f"fio - block: {means['fio'] - means['block']:.1f} us per request outside the disk")
PY
