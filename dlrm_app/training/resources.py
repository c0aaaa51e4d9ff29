"""What a run may use of this machine, and what the DLRM's tables need of it.

    topology = topology_for_run(world_size, local_world_size, device, args.memory_per_rank)
    try:
        plan = plan_for_env(model, env, [sharder], device, topology=topology)
    except PlannerError as e:
        raise planning_error_for_user(e) from None

The planner reads the memory this machine has free (``recsys_core.planner.detect_topology``);
``--memory-per-rank GIB`` overrides that. When the tables do not fit, the planner's error names
library remedies (Topology, storage_reservation); :func:`planning_error_for_user` keeps its
figures and names this application's flags instead. :func:`table_memory_bytes` is what the
preprocess command prints: the fp32 weights and optimizer state of a dataset's tables.
:func:`offload_error_for_user` words the errors of the tables kept on disk (a full
``--offload-dir``, a damaged backing file) with this application's flags.
"""

from __future__ import annotations

import errno
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dlrm_app.training.config import EmbeddingOptimizer

if TYPE_CHECKING:
    import torch

    from recsys_core.planner import MemoryShortfall, PlannerError, Topology

# torch and recsys_core are imported where they are used: preprocessing imports this module
# for table_memory_bytes (plain arithmetic) and would otherwise pay 3-5 s of torch import.

GIB = 1024**3
_FP32_BYTES = 4
_STATE_VALUES = {"EXACT_SGD": (0, 0), "EXACT_ADAGRAD": (0, 1), "EXACT_ROWWISE_ADAGRAD": (1, 0)}
"""Per fused kernel, its fp32 state values per row and per element: the planner's
``recsys_core.planner.estimators.weights_and_state_bytes`` for these optimizers (a test checks
that both agree)."""
# The suggested smaller sizes aim below the usable memory: buffers and the row-wise state do not
# shrink in proportion, and the estimate is the planner's, not a measurement.
SUGGESTION_HEADROOM = 0.8


def topology_for_run(
    world_size: int,
    local_world_size: int,
    device: torch.device | str,
    memory_per_rank_gib: float | None,
    offload_dir: str | os.PathLike | None = None,
) -> Topology:
    """The topology to plan this run for: the memory this machine has free (host memory, and on
    CUDA the device's free memory), or ``--memory-per-rank`` GiB per rank where given (host
    memory on CPU, GPU memory on CUDA); with ``offload_dir``, also the disk free there for
    tables kept in files behind a cache (CPU)."""
    # a positive finite number where given: TrainConfig checks it
    override = None if memory_per_rank_gib is None else int(memory_per_rank_gib * GIB)
    import torch

    from recsys_core.planner import detect_topology

    device = torch.device(device)
    return detect_topology(
        world_size, device.type, local_world_size=local_world_size, memory_per_rank=override,
        device=device if device.type == "cuda" else None,
        offload_dir=offload_dir if device.type == "cpu" else None,
    )


def table_memory_bytes(
    num_embeddings: Sequence[int], embedding_dim: int, optimizer: str | EmbeddingOptimizer
) -> int:
    """Bytes the tables need in training: fp32 weights plus the fused optimizer's state
    (rowwise_adagrad: one float per row, adagrad: one per element, sgd: none), summed. Buffers
    and dense parameters come on top (the planner keeps a reserve for them)."""
    try:
        per_row, per_element = _STATE_VALUES[EmbeddingOptimizer(optimizer).kernel]
    except ValueError:
        choices = ", ".join(o.value for o in EmbeddingOptimizer)
        raise ValueError(f"embedding optimizer {optimizer!r} is not one of {choices}") from None
    if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
        raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
    bad = [n for n in num_embeddings if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ValueError(f"num_embeddings must be positive ints (rows per table), got {bad}")
    dim = float(embedding_dim)
    state_per_row = _FP32_BYTES * per_row + _FP32_BYTES * per_element * dim
    return int(sum(float(rows) * dim * _FP32_BYTES + float(rows) * state_per_row
                   for rows in num_embeddings))


class DoesNotFit(ValueError):
    """The planner's refusal for a person, in lines: the first says what does not fit and the
    flag that fixes it, the next the figures behind it and the other fixes (the command line
    prints them as they are, where other errors become one line)."""


def planning_error_for_user(error: PlannerError, offload: bool = True,
                            memory_per_rank_gib: float | None = None) -> ValueError:
    """The planner's error about the DLRM's tables, with the fixes a user of this application
    has: its command-line flags (``offload``: whether the run allowed tables on disk;
    ``memory_per_rank_gib``: the ``--memory-per-rank`` given, None: read from the machine).
    Errors not about memory keep their message.

    A :class:`DoesNotFit` of a few lines: what does not fit and the fix to try first, then the
    planner's figures one sentence a line (what each rank has, where that figure came from,
    the largest tables), then every fix."""
    shortfall = error.shortfall
    if shortfall is None:
        return ValueError(str(error))
    fixes = _fixes(shortfall, offload)
    lines = [_headline(shortfall, offload, memory_per_rank_gib),
             *(f"  {line}" for line in _figures(shortfall)),
             "To fix, any one of:", *(f"  - {fix}" for fix in fixes)]
    return DoesNotFit("\n".join(lines))


def _headline(s: MemoryShortfall, offload: bool, memory_per_rank_gib: float | None) -> str:
    """What does not fit, in figures, and the flag to try first."""
    world = s.topology.world_size
    if s.needed_bytes > s.usable_bytes:
        what = (f"its tables need at least {_gib(s.needed_bytes)} of {s.memory}, "
                f"{_gib(s.usable_bytes)} usable on {world} rank{'s' if world > 1 else ''}")
    else:  # enough in all, but one table fits on no rank beside the others
        what = f"one table fits on no rank beside the others ({s.memory})"
    budget = None
    if memory_per_rank_gib is not None:
        budget = f"raise --memory-per-rank ({memory_per_rank_gib:g} GiB given"
        if s.needed_bytes > s.usable_bytes and s.reservation < 1.0 and \
                s.memory in ("host memory", "HBM"):
            need = s.needed_bytes / world / (1.0 - s.reservation) / GIB
            budget += f", this model needs about {need:.1f}"
        budget += ")"
    fixes = [] if budget is None or s.memory == "disk" else [budget]
    if s.memory in ("disk", "memory (host + disk)"):
        fixes.append("use an --offload-dir with more free space")
    elif not s.topology.is_cuda and not offload:
        fixes.append("drop --no-offload (tables then live on local disk behind a cache)")
    fix = " or ".join(fixes) or \
        f"make the tables smaller or add {'GPUs' if s.topology.is_cuda else 'nodes'}"
    return f"the model does not fit: {what}; {fix}"


def _figures(s: MemoryShortfall) -> list[str]:
    """The planner's summary one sentence a line (its first, the need, said in the first line
    already, reduced to what each rank has where the planner words it as usual), the largest
    tables without their module paths."""
    sentences = [t for t in re.split(r"(?<=\.) (?=[A-Z])", s.summary.strip()) if t]
    lines = []
    for sentence in sentences:
        if sentence.startswith("Largest tables:"):
            continue
        usual = re.fullmatch(r"the model does not fit: its tables need at least \S+ \S+ of "
                             + re.escape(s.memory) + r" \([^)]+\) but .+? usable: "
                             r"(?P<per_rank>.+?)\.?", sentence)
        lines.append(f"Usable: {usual['per_rank']}." if usual else sentence)
    lines.append(f"Largest tables: {', '.join(map(str, s.largest))}.")
    return lines


def offload_error_for_user(exc: BaseException) -> str | None:
    """One line for an error of the files under ``--offload-dir`` (None: not such an error).

    The backing files reserve their space when the model is built, so a disk without room
    fails there, before the first step; a row that reads back differently from what was
    written stops the run before it is trained on."""
    store = sys.modules.get("recsys_core.kernels.offload_store")
    if store is None:  # nothing was kept on disk in this process: not such an error
        return None
    OffloadSpaceError, OffloadCorruptionError = store.OffloadSpaceError, store.OffloadCorruptionError
    format_bytes, OFFLOAD_FILE_PREFIX = store.format_bytes, store.FILE_PREFIX
    if isinstance(exc, OffloadSpaceError):
        if exc.free < exc.needed:
            short = f"its disk has {format_bytes(exc.free)} ({exc.free} bytes) free"
        else:
            short = f"reserving them failed ({exc.strerror}: a quota or file size limit?)"
        return (f"--offload-dir {exc.directory}: the tables kept on disk need "
                f"{format_bytes(exc.needed)} ({exc.needed} bytes) there, but {short}; free "
                "space there, or pass --offload-dir DIR on a local disk with more room (the "
                "default is OUT/offload, on the disk of --out)")
    if isinstance(exc, OffloadCorruptionError):
        more = f" (and {exc.rows - 1} more rows)" if exc.rows > 1 else ""
        return (f"offload file {exc.path} of table {exc.table!r} is corrupt: row {exc.row}"
                f"{more} read back differently from what was written, so the run stopped "
                "before training on it; rerun with --resume to go on from the last checkpoint "
                "(verified when saved and when loaded), and check the disk of --offload-dir")
    path = getattr(exc, "filename", None) or ""
    if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            and os.path.basename(str(path)).startswith(OFFLOAD_FILE_PREFIX)):
        return (f"the disk of --offload-dir is full ({exc.strerror}; {path}): free space "
                "there, or pass --offload-dir DIR on a local disk with more room, then rerun "
                "with --resume")
    return None


def _fixes(s: MemoryShortfall, offload: bool = True) -> list[str]:
    topology = s.topology
    short = s.needed_bytes > s.usable_bytes  # False: it fits in total, one table fits nowhere
    target = SUGGESTION_HEADROOM * s.usable_bytes
    cap = _row_cap(s, target) if short else None
    # --embedding-dim sizes the tables of the largest dim (the DLRM's); the others (the wide
    # part's dim-1 tables) stay as they are
    dim = max((t.embedding_dim for t in s.tables), default=0)
    scaled = sum(t.needed_bytes for t in s.tables if t.embedding_dim == dim)
    fixed = s.needed_bytes - scaled
    new_dim = 8 * int(dim * (target - fixed) / scaled / 8) if short and scaled and \
        target > fixed else 0

    rows = ("smaller tables: preprocess again with a cap on rows per feature, "
            "`dlrm-app preprocess criteo ... --max-embeddings-per-feature N`")
    if cap is not None:
        capped = sum(t.needed_bytes * min(t.num_embeddings, cap) / t.num_embeddings for t in s.tables)
        rows += f", e.g. N = {cap} (about {_gib(capped)} instead of {_gib(s.needed_bytes)})"
    fixes = [rows + ", then train on the new dataset"]

    embeddings = "smaller embeddings: `dlrm-app train ... --embedding-dim N`"
    if 8 <= new_dim < dim:
        embeddings += f", e.g. N = {new_dim} instead of {dim}"
    fixes.append(embeddings + " (if you set --dense-arch-layer-sizes, end it with the same N)")

    if s.memory in ("disk", "memory (host + disk)"):
        # "disk": what the offloaded tables need; "memory (host + disk)": both tiers together,
        # an upper bound of the disk needed
        per_rank = s.needed_bytes / topology.world_size
        fixes.append("`dlrm-app train ... --offload-dir DIR` on a local disk with more free "
                     f"space: the tables kept on disk need at most about {_gib(per_rank)} per "
                     "rank (ranks on one host share its disk)")
    elif not topology.is_cuda and not offload:
        fixes.append("drop `--no-offload`: tables that do not fit in memory then live in files "
                     "on local disk (`--offload-dir`) behind a cache in memory; the model is the "
                     "same, training is slower")
    if s.memory == "disk":
        fixes.append("more nodes: `torchrun --nnodes M`; each holds a share of the tables")
        return fixes
    # the reservation (a share plus the dense parameters' estimate) can take a tiny budget whole
    kept = max(1.0 - s.reservation, 1e-9)
    per_rank = s.usable_bytes / topology.world_size / kept
    than = f"the {_gib(per_rank)} above" if s.reservation < 1.0 else "the budget above"
    memory = ("`dlrm-app train ... --memory-per-rank GIB` if each rank really has more free "
              f"memory than {than}")
    if short and s.memory != "memory (HBM + host)" and s.reservation < 1.0:
        need = s.needed_bytes / topology.world_size / kept
        memory += f"; this model needs about {need / GIB:.1f} GiB per rank"
    fixes.append(memory + " (memory other jobs are about to release; memory that is not there "
                 "fails the run with out-of-memory)")

    if topology.is_cuda and s.memory == "HBM":
        ranks = ""
        if short and s.usable_bytes > 0:
            per = s.usable_bytes / topology.world_size
            ranks = f" (about {math.ceil(s.needed_bytes / per)} GPUs in all)"
        fixes.append(f"more GPUs{ranks}: `torchrun --nproc-per-node G` on each node, or more "
                     "nodes (`torchrun --nnodes M`); each GPU holds a share of the tables")
    elif topology.is_cuda:
        fixes.append("more GPUs or nodes: `torchrun --nproc-per-node G`, `torchrun --nnodes M`")
    else:
        hosts = ""
        if short and s.usable_bytes > 0:
            per_host = s.usable_bytes / topology.num_hosts
            hosts = f" (about {math.ceil(s.needed_bytes / per_host)} in all)"
        fixes.append(f"more nodes{hosts}: `torchrun --nnodes M --nproc-per-node "
                     f"{topology.local_size}`; more ranks on this host "
                     "(`--nproc-per-node`) share its memory and do not add any")
    return fixes


def _row_cap(s: MemoryShortfall, target: float) -> int | None:
    """The largest rows-per-table cap, rounded down to two significant digits, under which the
    tables need at most ``target`` bytes (a table's need taken as proportional to its rows)."""
    def need(cap: int) -> float:
        return sum(t.needed_bytes * min(t.num_embeddings, cap) / t.num_embeddings for t in s.tables)

    low, high = 0, max(t.num_embeddings for t in s.tables)
    while low < high:  # largest cap with need(cap) <= target
        mid = (low + high + 1) // 2
        if need(mid) <= target:
            low = mid
        else:
            high = mid - 1
    if low < 1:
        return None
    step = 10 ** max(0, len(str(low)) - 2)
    return low // step * step


def _gib(value: float) -> str:
    """Bytes in the unit that fits them (``12.30 KiB``, not ``0.00 GiB``; this module stays
    torch-free, so not ``recsys_core.planner.units``)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"
