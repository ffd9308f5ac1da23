"""What one optimizer step of a training process does besides computing: the collectives it runs, and the calls that
would make the host wait for the device. Used by tests/test_sync_free_step.py and by GPU benchmarks; nothing in the
scripts knows of it. Put this folder FIRST on the PYTHONPATH of a launched run (the launcher passes it on to every
process); a sitecustomize.py found later on the path (tests/fake_gpu's, a distribution's) is still run, before this one:

    STEP_PROBE=count STEP_PROBE_OUT=probe PYTHONPATH=tools/step_probe${PYTHONPATH:+:$PYTHONPATH} \
        accelerate launch --config_file accelerate_configs/4gpu.yaml train_resnet.py ...

Environment variables (nothing is changed without one of them):
- STEP_PROBE: a comma-separated list of modes.
  - `count` (with STEP_PROBE_OUT=DIR): each process that took a training step writes DIR/rank<R>.json (R: the
    launcher's RANK, 0 without one) when it exits; the format is below.
  - `sync_debug`: torch.cuda.set_sync_debug_mode("error") inside the steady steps, so that any host-device
    synchronisation there raises (CUDA only). A step turns it on when it begins if it can be steady (past the first
    STEP_PROBE_WARMUP steps, the step before did not log, evaluate, save or stop), and off once it is due to log,
    evaluate or save (utils/loop.py Cadence.after_step), once the ranks agree to stop, and when the training steps
    end: what a step computes runs under it; what a logging, evaluating or saving step does after that does not.
- STEP_PROBE_DEVICE_AGREEMENT=1: the run agrees on its cross-rank decisions the way accelerate's
  set_trigger/check_trigger do: at every check (utils/loop.py PreemptionGuard.should_stop, HostChannel.any), an
  all-reduce of the flag on the training device, on the training group, read back with `.item()` (on one process, no
  collective, as then). Alone or with the modes above.
- STEP_PROBE_WARMUP: how many steps a process takes before one can be steady (default 2: the first steps build
  DDP's buckets, the optimizer's state and the allocator's pools).

What a step is: from the start of its first batch (utils/loop.py PreemptionGuard.start_window, which both scripts call
once per optimizer step) to the start of the next step's, or to the end of the training steps (PreemptionGuard.close):
its forward and backward passes, the optimizer step, the loop's bookkeeping after it (log line, validation,
checkpoint, the stop decision), and the fetch of the next batch.

rank<R>.json: {"rank", "world_size", "warmup_steps", "device_agreement" (bool), "next_sitecustomize" (the file run
before this one, or null), "steps": [one object per step, in order]}, and each step:
- "step": the optimizer step it took, counted from the run's start (Cadence.after_step's), null for a step that
  stopped inside its accumulation window;
- "logged", "evaluated", "saved" (what Cadence.after_step said was due), "stopped" (the ranks agreed to stop in it);
- "steady": not among the first warmup_steps steps of this process, and neither it nor the step before logged,
  evaluated, saved or stopped;
- "collectives": {"training": {name: count}, "host": {...}, "other": {...}}: the torch.distributed calls made from
  Python (all_reduce, broadcast, all_gather_object, barrier, DDP's _broadcast_coalesced of its buffers, ...; a call
  another one makes inside it is not counted again), by group: the default (training) group, the host channel's gloo
  group (utils/runtime.py HostChannel), any other. DDP's gradient all-reduce runs in C++ from autograd hooks and is
  not seen here;
- "collective_sites": {"GROUP NAME SITE": count}: where those calls were made;
- "syncs": {name: count} and "sync_sites": {SITE: count}: the Python-level calls that read a tensor on the training
  device back to the host (Tensor.item, Tensor.cpu, Tensor.tolist, Tensor.numpy, bool(tensor), int(tensor),
  float(tensor), index(tensor)); on a GPU run, a CUDA tensor's (reading a CPU tensor waits for nothing). A SITE is
  "file:line function" of the frame that made the call, then " < " and those of its first two callers outside
  installed packages (paths relative to the working directory). On a CPU run every tensor lives on the training
  device, so two kinds of host tensor are told apart by where they are read: inside a DataLoader's fetch (the batch
  is made on the host, in workers on a real run) and inside HostChannel.start and Agreement.result (the flag is a CPU
  tensor by construction; replaced under STEP_PROBE_DEVICE_AGREEMENT); calls there are not counted.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


def _run_next_sitecustomize():
    """Run the sitecustomize.py that Python would have imported without this folder first on the path; its path."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(entry or os.getcwd()) for entry in sys.path]
    later = entries[entries.index(here) + 1:] if here in entries else entries
    for directory in later:
        path = os.path.join(directory, "sitecustomize.py")
        if directory != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return path
    return None


NEXT_SITECUSTOMIZE = _run_next_sitecustomize()
MODES = {mode.strip() for mode in os.environ.get("STEP_PROBE", "").split(",") if mode.strip()}
DEVICE_AGREEMENT = os.environ.get("STEP_PROBE_DEVICE_AGREEMENT") == "1"


def _refuse(line):
    """One line and exit status 2, from where an exception would be a fatal error of the interpreter's start."""
    sys.stderr.write(f"error: {line}\n")
    os._exit(2)


if MODES - {"count", "sync_debug"}:
    _refuse(f"STEP_PROBE={os.environ['STEP_PROBE']}: the modes are count and sync_debug")
if "count" in MODES and not os.environ.get("STEP_PROBE_OUT"):
    _refuse("STEP_PROBE=count needs STEP_PROBE_OUT=DIR, where each process writes rank<R>.json")

# ------------------------------------------------------------------------------------------------------------------
if MODES or DEVICE_AGREEMENT:
    import atexit
    import collections
    import inspect
    import json
    import threading

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    WARMUP = int(os.environ.get("STEP_PROBE_WARMUP", "2"))
    SYNC_METHODS = {"item": "Tensor.item", "cpu": "Tensor.cpu", "tolist": "Tensor.tolist", "numpy": "Tensor.numpy",
                    "__bool__": "bool(tensor)", "__int__": "int(tensor)", "__float__": "float(tensor)",
                    "__index__": "index(tensor)"}
    COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list", "all_gather",
                   "all_gather_into_tensor", "all_gather_object", "gather", "gather_object", "scatter",
                   "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                   "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
                   "batch_isend_irecv", "_broadcast_coalesced")

    _local = threading.local()  # depth of a collective in progress, of a region whose tensors are the host's
    host_groups = []  # the host channel's process group(s)

    class Step:
        def __init__(self, index):
            self.index, self.step = index, None
            self.logged = self.evaluated = self.saved = self.stopped = False
            self.collectives = {"training": collections.Counter(), "host": collections.Counter(),
                                "other": collections.Counter()}
            self.collective_sites = collections.Counter()
            self.syncs, self.sites = collections.Counter(), collections.Counter()

        @property
        def busy(self):
            """Logged, evaluated, saved or stopped: what makes it and the next step not steady."""
            return self.logged or self.evaluated or self.saved or self.stopped

        def record(self, previous):
            steady = self.index >= WARMUP and self.step is not None and not self.busy and not previous.busy
            return {"step": self.step, "steady": steady, "logged": self.logged, "evaluated": self.evaluated,
                    "saved": self.saved, "stopped": self.stopped,
                    "collectives": {group: dict(calls) for group, calls in self.collectives.items()},
                    "collective_sites": dict(self.collective_sites),
                    "syncs": dict(self.syncs), "sync_sites": dict(self.sites)}

    steps = []  # every step this process took, in order
    now = {"step": None}  # the step in progress; None outside the training steps

    def current():
        return now["step"]

    # -- sync_debug ------------------------------------------------------------------------------------------------
    def sync_debug(on):
        if "sync_debug" not in MODES:
            return
        if not torch.cuda.is_available():
            raise RuntimeError("STEP_PROBE=sync_debug checks CUDA's synchronisations, and this run has no CUDA device")
        torch.cuda.set_sync_debug_mode("error" if on else "default")

    # -- the loop's step boundaries (utils/loop.py), patched once the module is imported --------------------------
    def patch_loop(loop):
        from utils import runtime

        start_window, after_step = loop.PreemptionGuard.start_window, loop.Cadence.after_step
        should_stop, close = loop.PreemptionGuard.should_stop, loop.PreemptionGuard.close
        if DEVICE_AGREEMENT:
            should_stop = should_stop_on_the_device

        def start_window_of_a_step(self, batches_in_epoch, model):
            previous = steps[-1] if steps else None
            now["step"] = Step(len(steps))
            steps.append(now["step"])
            sync_debug(now["step"].index >= WARMUP and not (previous and previous.busy))
            return start_window(self, batches_in_epoch, model)

        def after_step_noted(self, completed_steps, batches_in_epoch):
            due = after_step(self, completed_steps, batches_in_epoch)
            step = current()
            if step is not None:
                step.step = completed_steps
                step.logged, step.evaluated, step.saved = due.log, due.evaluate, due.checkpoint
                if step.busy:
                    sync_debug(False)
            return due

        def should_stop_noted(self, *args, **kwargs):
            stop = should_stop(self, *args, **kwargs)
            if stop and current() is not None:
                current().stopped = True
                sync_debug(False)
            return stop

        def close_noted(self, *args, **kwargs):
            sync_debug(False)
            now["step"] = None  # the training steps are over: what follows belongs to no step
            return close(self, *args, **kwargs)

        loop.PreemptionGuard.start_window = start_window_of_a_step
        loop.Cadence.after_step = after_step_noted
        loop.PreemptionGuard.should_stop = should_stop_noted
        loop.PreemptionGuard.close = close_noted
        patch_host_channel(runtime)

    def patch_host_channel(runtime):
        channel, agreement = runtime.HostChannel, runtime.Agreement
        init, start, result = channel.__init__, channel.start, agreement.result

        def init_noted(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if getattr(self, "group", None) is not None:
                host_groups.append(self.group)

        def start_on_the_host(self, values):
            with host_tensors():
                return start(self, values)

        def result_on_the_host(self):
            with host_tensors():
                return result(self)

        channel.__init__ = init_noted
        channel.start = start_on_the_host
        agreement.result = result_on_the_host
        if DEVICE_AGREEMENT:
            channel.any = any_on_the_device

    def any_on_the_device(self, flag):
        """accelerate's set_trigger/check_trigger: the flag all-reduced on the training device, then read."""
        if self.group is None:
            return bool(flag)
        if not hasattr(self, "on_the_device"):  # made once, as accelerate's flag_tensor
            from accelerate.state import PartialState

            self.on_the_device = torch.zeros((), device=PartialState().device)
        self.on_the_device.fill_(float(bool(flag)))
        dist.all_reduce(self.on_the_device)
        return self.on_the_device.item() > 0

    def should_stop_on_the_device(self, completed_steps=None):
        """The stop decided at every check, blocking, on the training device (any_on_the_device)."""
        self.step = completed_steps
        self.agreed = self.agreed or any_on_the_device(self.channel, self.received is not None)
        return self.agreed

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        """Runs `then(module)` once the module `name` has been executed."""

        def __init__(self, name, then):
            self.name, self.then = name, then

        def find_spec(self, fullname, path, target=None):
            if fullname != self.name:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module, then = spec.loader.exec_module, self.then

            def exec_then_patch(module):
                exec_module(module)
                then(module)
            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, PatchAfterImport("utils.loop", patch_loop))

    # -- counting --------------------------------------------------------------------------------------------------
    class host_tensors:
        """A region whose tensors are the host's on any machine (a DataLoader's fetch, the host channel's flag)."""

        def __enter__(self):
            _local.host = getattr(_local, "host", 0) + 1

        def __exit__(self, *exc):
            _local.host -= 1

    def training_device():
        from accelerate.state import PartialState  # its state read, never created: that would choose the launch

        return PartialState._shared_state.get("device")

    def count_sync(name, tensor):
        step = current()
        if step is None or getattr(_local, "host", 0):
            return
        device = training_device()
        if device is not None and tensor.device.type != torch.device(device).type:
            return  # a host tensor on a machine whose training device is not the CPU
        step.syncs[name] += 1
        step.sites[site(sys._getframe(2))] += 1

    def site(frame):
        """The frame that made the call, then its first two callers outside installed packages: "A < B < C"."""
        def where(f):
            return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"

        places, caller = [where(frame)], frame.f_back
        while caller is not None and len(places) < 3:
            if "-packages" + os.sep not in caller.f_code.co_filename and caller.f_code.co_filename != __file__:
                places.append(where(caller))
            caller = caller.f_back
        return " < ".join(places)

    def counted_sync(method, name):
        original = getattr(torch.Tensor, method)

        def call(self, *args, **kwargs):
            count_sync(name, self)
            return original(self, *args, **kwargs)
        call.__name__ = method
        return call

    def group_of(signature, args, kwargs):
        if signature is None:  # _broadcast_coalesced, a pybind function: (process_group, tensors, buffer_size, src)
            return args[0] if args else kwargs.get("process_group")
        bound = signature.bind_partial(*args, **kwargs).arguments
        return bound.get("group", bound.get("process_group"))

    def group_name(group):
        if group is None or group is dist.GroupMember.WORLD or group is c10d._get_default_group():
            return "training"
        return "host" if any(group is host for host in host_groups) else "other"

    def counted_collective(name, original):
        signature = None if name == "_broadcast_coalesced" else inspect.signature(original)

        def call(*args, **kwargs):
            depth = getattr(_local, "collective", 0)
            step = current()
            if depth == 0 and step is not None:
                group = group_name(group_of(signature, args, kwargs))
                step.collectives[group][name] += 1
                step.collective_sites[f"{group} {name} {site(sys._getframe(1))}"] += 1
            _local.collective = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                _local.collective = depth
        call.__name__ = name
        return call

    if "count" in MODES:
        for method, name in SYNC_METHODS.items():
            setattr(torch.Tensor, method, counted_sync(method, name))
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = counted_collective(name, original)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is original:  # the calls collectives make to each other
                setattr(c10d, name, wrapped)

        fetch = torch.utils.data.dataloader._BaseDataLoaderIter.__next__

        def fetch_on_the_host(self):
            with host_tensors():
                return fetch(self)
        torch.utils.data.dataloader._BaseDataLoaderIter.__next__ = fetch_on_the_host

        def write_counts():
            if not steps:
                return  # the launcher, or a process that trained nothing
            out = os.environ["STEP_PROBE_OUT"]
            os.makedirs(out, exist_ok=True)
            rank = int(os.environ.get("RANK", "0"))
            previous = [Step(-1)] + steps[:-1]
            report = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "warmup_steps": WARMUP,
                      "device_agreement": DEVICE_AGREEMENT, "next_sitecustomize": NEXT_SITECUSTOMIZE,
                      "steps": [step.record(before) for step, before in zip(steps, previous)]}
            path = os.path.join(out, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(path + ".tmp", path)

        atexit.register(write_counts)
