"""The serving programs' jit arguments and compile budget (``jdspark.slots``, ``jdspark.prefix``): NNX modules as a
static, cheaply hashed graph plus a flat tuple of arrays, and the memory maps XLA:CPU's compiled programs hold."""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from typing import Optional

import jax
from flax import nnx

__all__ = ["StaticGraph", "split_module", "merge_module", "MAP_HEADROOM", "memory_maps", "check_map_budget",
           "MapBudgetError", "MapGuard", "TYPICAL_SHARE", "LARGEST_SHARE", "COMPILE_CACHE_DIR", "use_compile_cache"]

# ``SlotBackend.compile_all`` on a CPU: memory maps kept free of the serving programs' estimate, for what else the
# process maps (thread stacks, arrays, sockets, later compiles such as an image grid's vision tower). XLA:CPU maps
# each fused kernel of a program on its own (code, constants and data: 3 maps a kernel), ~1000 maps a step program
# of the shipped pair; the default server's 44 programs hold ~46k of Linux's default vm.max_map_count of 65530, and
# a compile past the limit aborts the process inside LLVM ("Unable to allocate section memory").
MAP_HEADROOM = 4096
# A program's maps over those of the one priced first (the widest step of the largest batch bucket), measured on
# the default server's 49 programs: 0.88 on average (0.89 without constrained decoding compiled in), 1.15 at most
# (a multi-step launch). The start-up estimate prices every program at TYPICAL_SHARE of the first; each compile
# then starts only where it and those in flight fit at LARGEST_SHARE (``MapGuard``).
TYPICAL_SHARE = 0.85
LARGEST_SHARE = 1.25


# Where a server keeps its compiled programs between start-ups (``use_compile_cache``; JAX's persistent cache,
# keyed by the program, the XLA flags and the versions, so a changed program or jaxlib compiles anew).
COMPILE_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jdspark", "xla")


def use_compile_cache(path: Optional[str]) -> Optional[str]:
    """Keep compiled programs that took over a second in ``path`` (None or "none": off) and load them from there
    on the next start-up instead of compiling them again: the same executables, so the same numbers. Call before
    the first compile. Returns the folder used, or None."""
    if path is None or path == "none":
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


XLA_CPU_WORKER = "tf_XLAEigen"  # what XLA:CPU names its intra-op worker threads (/proc/<pid>/task/<tid>/comm)


def pin_cpu_workers(name: str = XLA_CPU_WORKER) -> list:
    """Pin each of XLA:CPU's intra-op worker threads (``name``) to its own core of this process's CPU set, round
    robin; returns the (thread id, core) pairs pinned ([] off Linux, with one core, or before the runtime has made
    its threads: call after the first computation).

    Why: after the process had been idle for 50 ms or more, a 128-token prefill ran at about one core's speed (42-50
    ms against 28-36 back to back on this 2-core machine; on one core, 35-45 ms either way): Linux wakes a sleeping
    worker next to the thread that wakes it, and the two share a core until the load balancer moves one. Pinned, the
    same prefill after a pause took 28.6-35.0 ms (docs/serving.md, "Slow after idle"). A pinned thread cannot move
    off a core another process keeps busy, so a server sharing its cores may prefer ``--pin-threads off``."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        tids = []
        for t in sorted(os.listdir("/proc/self/task"), key=int):
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() == name:
                    tids.append(int(t))
    except (OSError, AttributeError):  # not Linux
        return []
    if len(cpus) < 2:
        return []
    pinned = []
    for k, tid in enumerate(tids):
        try:
            os.sched_setaffinity(tid, {cpus[k % len(cpus)]})
        except OSError:  # a thread that has ended since it was listed
            continue
        pinned.append((tid, cpus[k % len(cpus)]))
    return pinned


class StaticGraph:
    """A jit static argument whose hash is computed once and whose equality tries identity first: an nnx GraphDef
    hashes and compares structurally, ~2 ms per step on the default pair, paid on every call otherwise."""

    __slots__ = ("obj", "_hash")

    def __init__(self, obj):
        self.obj, self._hash = obj, hash(obj)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, StaticGraph) and (other.obj is self.obj or other.obj == self.obj)


def split_module(module) -> tuple:
    """A module as (static graph and tree structure, its arrays as a flat tuple). Passed to a jit as a tuple of
    arrays its ~300 leaves dispatch in C++; as an nnx State each step paid Python flattening of every Variable
    (~1.5 ms of a ~7 ms batch-1 step on the default pair)."""
    graph, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    return StaticGraph((graph, tree)), tuple(leaves)


def merge_module(graph: Optional[StaticGraph], leaves):
    if graph is None:
        return None
    g, tree = graph.obj
    return nnx.merge(g, jax.tree.unflatten(tree, leaves))


def memory_maps() -> Optional[tuple]:
    """(memory maps this process holds, the system's limit ``vm.max_map_count``), or None where ``/proc`` does not
    say (not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return used, limit


class MapGuard:
    """Lets a compile start only while it and the compiles in flight, each priced at ``LARGEST_SHARE`` x ``price``,
    fit under the limit less MAP_HEADROOM as the process's maps stand now (``enter`` raises ``MapBudgetError``
    otherwise); ``leave`` when a compile ends. The start-up estimate is typical, not a bound: this keeps a server
    that would fit from being refused and one that would not from aborting inside LLVM part-way."""

    def __init__(self, programs: int, price: int, read=None):
        self.waiting, self.price, self.in_flight = programs, max(int(price), 1), 0
        self.read = read or memory_maps
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            maps = self.read()
            if maps is not None:
                used, limit = maps
                if used + (self.in_flight + 1) * math.ceil(LARGEST_SHARE * self.price) > limit - MAP_HEADROOM:
                    raise MapBudgetError(
                        f"{self.waiting} serving programs are still to compile, ~{int(TYPICAL_SHARE * self.price)} "
                        f"memory maps a program (XLA:CPU maps each fused kernel on its own), and {used} are held "
                        f"now: the next compile could pass this system's limit of {limit} (vm.max_map_count) less "
                        f"{MAP_HEADROOM} kept free. {_ADVICE}")
            self.waiting -= 1
            self.in_flight += 1

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class MapBudgetError(RuntimeError):
    """The serving programs would need more memory maps than the system allows (``check_map_budget``)."""


_ADVICE = ("Serve fewer programs (fewer --prompt-buckets, fewer --slots: a batch bucket per power of two; "
           "--guided-states 0 or --no-logprobs make each smaller) or raise the limit "
           "(sysctl -w vm.max_map_count=262144)")


def check_map_budget(remaining: int, per_program: int, used: int, limit: int) -> None:
    """Raise ``MapBudgetError`` before compiling ``remaining`` more programs of ``per_program`` memory maps each,
    where

        used + remaining * per_program > limit - MAP_HEADROOM

    (``memory_maps``; XLA:CPU maps each fused kernel on its own, see MAP_HEADROOM): past the limit the process
    would abort inside LLVM part-way through start-up, naming nothing a user can change."""
    need = used + remaining * max(per_program, 0)
    if need > limit - MAP_HEADROOM:
        raise MapBudgetError(
            f"compiling the serving programs needs about {need} memory maps ({remaining + 1} programs, ~{per_program} "
            f"a program: XLA:CPU maps each fused kernel on its own; {used} held now), over this system's limit of "
            f"{limit} (vm.max_map_count) less {MAP_HEADROOM} kept free. {_ADVICE}")


# ``compile_programs``: at most this many programs compile at once (each compile holds its own XLA memory)
COMPILE_THREADS = 8


def compile_programs(progs: list, threads: Optional[int] = None, optional: list = ()) -> int:
    """Compile ``progs`` (jitted function, args, static kwargs) ahead of time, ``threads`` at a time (default: the
    machine's cores, at most COMPILE_THREADS): XLA compiles outside the GIL, so on a many-core host start-up takes a
    fraction of one compile after another (on the H200 machine the server's ~50 programs had not compiled in 190 s,
    one at a time). On a CPU the last program (the serving slots': the widest step of the largest batch bucket) is
    compiled first and prices the others in memory maps: a clear error (``check_map_budget``) instead of an abort in
    the middle of start-up, then each compile waits for room (``MapGuard``). ``optional``: programs compiled with
    them where the memory maps allow all of them, else none of them (the caller serves without: a smaller budget
    is no error). Returns the number of programs compiled."""
    n = max(1, min(threads or (os.cpu_count() or 1), COMPILE_THREADS))

    def compile_one(prog) -> None:
        fn, args, kw = prog
        fn.lower(*args, **kw).compile()

    before = memory_maps() if jax.default_backend() == "cpu" else None
    rest, guard, optional = progs, None, list(optional)
    if before is not None and len(progs) + len(optional) > 1:
        compile_one(progs[-1])
        after = memory_maps()
        if after is not None:
            price = after[0] - before[0]
            if optional:
                try:
                    check_map_budget(len(progs) + len(optional) - 1, int(TYPICAL_SHARE * price), after[0], after[1])
                except MapBudgetError:
                    optional = []
            check_map_budget(len(progs) + len(optional) - 1, int(TYPICAL_SHARE * price), after[0], after[1])
            guard = MapGuard(len(progs) + len(optional) - 1, price, read=memory_maps)
        rest = progs[:-1]
    rest = rest + optional

    def compile_guarded(prog) -> None:
        if guard is None:
            return compile_one(prog)
        guard.enter()
        try:
            compile_one(prog)
        finally:
            guard.leave()

    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="jdspark-compile") as pool:
        list(pool.map(compile_guarded, rest))
    return len(progs) + len(optional)
