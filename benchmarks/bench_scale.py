"""What the run's coordination costs as the number of processes grows: measured here over loopback, modelled beyond.

    python benchmarks/bench_scale.py              # N = 2, 4, 8, 16 processes, about 3 minutes on 2 cores
    python benchmarks/bench_scale.py --quick      # N = 2, 4, seconds

For each N, torchrun starts N processes (gloo over 127.0.0.1, one thread each). Each builds the scripts' Accelerator
(utils/runtime.py build_accelerator: the training group and the host channel), then runs, interleaved in rounds:
- ring: --ring_ops blocking all-reduces of one flag on the host channel, back to back (HostChannel.any);
- blocking: --steps steps of --step_ms that use no CPU (a sleep: a GPU step leaves the host idle; each rank's step
  is up to --jitter longer or shorter at random, as hosts are never equal), each followed by a blocking check;
- agreement: the same steps, each followed by the run's own check (utils/loop.py PreemptionGuard.should_stop).
Then, once: the time and files to open one more gloo group (HostChannel.open, as the run opens its host channel),
the start-up agreements (a gather_object and a broadcast_object_list, as hold_output_dir and agree_on_resume run)
and the roll call of a stop (RollCall.absent, every rank answering). A least-squares fit of the ring's time
against its 2(N-1) messages gives this host's latency per message; the model then prints what the checks cost at
128 and 1,024 processes with it and with --message_us (a cluster network's: an assumption, not a measurement), the
run's checks agreeing about every utils/loop.py AGREEMENT_SECONDS.
"""
import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (puts the repo root on sys.path)

from utils.loop import AGREEMENT_SECONDS, MAX_CHECKS_PER_AGREEMENT  # noqa: E402
from utils.runtime import FILES_FOR_NCCL, FILES_PER_GLOO_GROUP  # noqa: E402

MODELLED = (128, 1024)


def open_files():
    return len(os.listdir("/proc/self/fd"))


def per_step(step_s, jitter, steps, rng, check):
    """Seconds inside `check(step)` after each of `steps` idle steps of about `step_s`."""
    inside = []
    for step in range(steps):
        time.sleep(step_s * (1 + rng.uniform(-jitter, jitter)))
        start = time.perf_counter()
        check(step)
        inside.append(time.perf_counter() - start)
    return inside


def worker(args):
    """One rank of a launch: what it measured, written to args.worker/rank<R>.json."""
    from accelerate.utils import broadcast_object_list, gather_object

    from utils.loop import PreemptionGuard
    from utils.runtime import HostChannel, RollCall

    harness.set_threads(args.threads)
    accelerator = harness.script_accelerator(cpu=True)
    rank = accelerator.process_index
    rng = random.Random(harness.SEED + rank)
    before, start = open_files(), time.perf_counter()
    channel = HostChannel.open(accelerator, datetime.timedelta(seconds=300))  # the run's host channel, once more
    channel.any(False)  # connected
    opened = {"open_seconds": time.perf_counter() - start, "open_files": open_files() - before}

    def ring():
        return [timed(lambda: channel.any(False)) for _ in range(args.ring_ops)]

    def blocking():
        return per_step(args.step_ms / 1000, args.jitter, args.steps, rng, lambda step: channel.any(False))

    def agreement():
        guard = PreemptionGuard(accelerator)
        inside = per_step(args.step_ms / 1000, args.jitter, args.steps, rng, guard.should_stop)
        guard.close(preempted=True)  # finishes the agreement in flight, outside the steps
        return inside

    arms, measured = {"ring": ring, "blocking": blocking, "agreement": agreement}, {}
    for round_index in range(args.rounds):
        for name in harness.interleaved_order(arms, round_index):
            accelerator.wait_for_everyone()
            measured.setdefault(name, []).extend(arms[name]())
    accelerator.wait_for_everyone()
    startup = {"gather_object_seconds": timed(lambda: gather_object([rank])),
               "broadcast_object_list_seconds": timed(lambda: broadcast_object_list([rank]))}
    accelerator.wait_for_everyone()
    startup["roll_call_seconds"] = timed(RollCall.absent)
    record = {"rank": rank, "processes": accelerator.num_processes, **opened, **startup, "seconds": measured}
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()


def timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def launch(processes, args, folder):
    """torchrun of `processes` workers; each rank's record."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
               "127.0.0.1", "--master_port", str(harness.free_port()), __file__, "--worker", str(folder),
               "--steps", str(args.steps), "--step_ms", str(args.step_ms), "--jitter", str(args.jitter),
               "--ring_ops", str(args.ring_ops), "--rounds", str(args.rounds), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, cwd=harness.REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{processes} processes failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(processes)]


def summary(records):
    """Per launch: medians over ranks of each rank's median ring time and mean time per step inside each check."""
    def ms(values):
        return 1000 * statistics.median(values)
    return {"processes": records[0]["processes"],
            "ring_ms": ms([statistics.median(r["seconds"]["ring"]) for r in records]),
            "blocking_ms_per_step": ms([statistics.mean(r["seconds"]["blocking"]) for r in records]),
            "agreement_ms_per_step": ms([statistics.mean(r["seconds"]["agreement"]) for r in records]),
            "agreement_max_ms_per_step": 1000 * max(statistics.mean(r["seconds"]["agreement"]) for r in records),
            "open_seconds": max(r["open_seconds"] for r in records),
            "open_files_per_process": statistics.median(r["open_files"] for r in records),
            "gather_object_ms": ms([r["gather_object_seconds"] for r in records]),
            "broadcast_object_list_ms": ms([r["broadcast_object_list_seconds"] for r in records]),
            "roll_call_seconds": max(r["roll_call_seconds"] for r in records)}


def fit(points):
    """Least squares of ring ms = fixed + per_message x 2(N-1)."""
    xs, ys = [2 * (n - 1) for n, _ in points], [ms for _, ms in points]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def model(processes, per_message_ms, step_ms):
    """A check's cost per step at `processes`: the ring's time when every check waits for it (blocking); with the
    run's cadence (one agreement about every AGREEMENT_SECONDS), what is left of the ring after the steps it has to
    finish, per step."""
    ring_ms = 2 * (processes - 1) * per_message_ms
    every = min(MAX_CHECKS_PER_AGREEMENT, max(1, round(AGREEMENT_SECONDS * 1000 / step_ms)))
    return ring_ms, every, max(0.0, ring_ms - every * step_ms) / every


def main(argv=None):
    parser = harness.base_parser(__doc__, data=False)
    parser.add_argument("--processes", type=int, nargs="+", default=None, help="launch sizes (default 2 4 8 16)")
    parser.add_argument("--steps", type=int, default=None, help="idle steps per arm and round (default 50)")
    parser.add_argument("--step_ms", type=float, default=20.0, help="one idle step, milliseconds")
    parser.add_argument("--jitter", type=float, default=0.1, help="each step up to this fraction longer or shorter")
    parser.add_argument("--ring_ops", type=int, default=None, help="back-to-back all-reduces per round (default 300)")
    parser.add_argument("--message_us", type=float, default=25.0,
                        help="a cluster network's latency per message, for the model (an assumption)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a rank of a launch
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (10 if args.quick else 50)
    args.ring_ops = args.ring_ops or (50 if args.quick else 300)
    if args.worker:
        return worker(args)
    sizes = args.processes or ([2, 4] if args.quick else [2, 4, 8, 16])
    provenance, measured = harness.provenance(), []  # the machine as the launches found it
    with tempfile.TemporaryDirectory() as folder:
        for processes in sizes:
            print(f"{processes} processes ...", flush=True)
            launch_folder = Path(folder, str(processes))
            launch_folder.mkdir()
            measured.append(summary(launch(processes, args, launch_folder)))
    fixed, per_message = fit([(m["processes"], m["ring_ms"]) for m in measured])
    print(harness.format_table(
        ["processes", "ring all-reduce ms", "blocking check ms/step", "run's check ms/step (max over ranks)",
         "open a gloo group s", "its files per process", "gather_object ms", "broadcast_object_list ms",
         "roll call s"],
        [[m["processes"], m["ring_ms"], m["blocking_ms_per_step"],
          f"{m['agreement_ms_per_step']:.3f} ({m['agreement_max_ms_per_step']:.3f})", m["open_seconds"],
          m["open_files_per_process"], m["gather_object_ms"], m["broadcast_object_list_ms"], m["roll_call_seconds"]]
         for m in measured]))
    print(f"\nring all-reduce ~ {fixed:.3f} ms + {per_message * 1000:.1f} us x 2(N-1) messages (least squares, this "
          f"host); modelled with {per_message * 1000:.1f} us (this host) and {args.message_us:g} us (--message_us) a "
          f"message, {args.step_ms:g} ms steps:")
    rows = []
    for processes in MODELLED:
        here, every, left_here = model(processes, per_message, args.step_ms)
        cluster, _, left_cluster = model(processes, args.message_us / 1000, args.step_ms)
        files = 2 * (processes + FILES_PER_GLOO_GROUP)  # CPU: gloo training group + host channel
        rows.append([processes, 2 * (processes - 1), here, cluster, every, left_here, left_cluster, files,
                     processes + FILES_PER_GLOO_GROUP + FILES_FOR_NCCL])
    print(harness.format_table(
        ["processes", "messages", "blocking ms/step (this host)", "blocking ms/step (cluster)", "checks per agreement",
         "run's check ms/step (this host)", "run's check ms/step (cluster)", "files per process, gloo",
         "files per process, NCCL (budget)"], rows))
    harness.write_results("bench_scale", {"provenance": provenance, "settings": {
        "processes": sizes, "steps": args.steps, "step_ms": args.step_ms, "jitter": args.jitter,
        "ring_ops": args.ring_ops, "rounds": args.rounds, "message_us": args.message_us},
        "measured": measured, "fit": {"fixed_ms": fixed, "per_message_ms": per_message},
        "model": [dict(zip(["processes", "messages", "blocking_ms_here", "blocking_ms_cluster",
                            "checks_per_agreement", "check_ms_here", "check_ms_cluster", "files_gloo",
                            "files_nccl_budget"], row)) for row in rows]}, args.output)


if __name__ == "__main__":
    harness.run_cli(main, sys.argv[1:])
