"""The training loop in one process: it learns, pipelined == plain, resume == uninterrupted,
checkpoints are atomic, the LR schedule and config are what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from app_setup import SMALL_MODEL, four_feature_data

from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.training import checkpoint as app_checkpoint
from dlrm_app.training.checkpoint import latest_checkpoint
from dlrm_app.training.config import (
    MIN_LR_SCALE,
    EmbeddingOptimizer,
    TrainConfig,
    flatten,
    lr_scale,
)
from dlrm_app.training.evaluate import evaluate_checkpoint
from dlrm_app.training.trainer import train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return four_feature_data(tmp_path_factory.mktemp("synthetic"), rows=30_000,
                             rows_per_shard=10_000, row_group_size=256)


def _config(data: Path, out: Path, **kw: object) -> TrainConfig:
    # validation at epoch ends only and no early stopping unless a test asks for them
    base = dict(data=str(data), out=str(out), model=SMALL_MODEL, batch_size=256, log_every=1,
                embedding_learning_rate=0.1, learning_rate=0.05, validate_every=0, patience=0)
    base.update(kw)
    return TrainConfig.from_flags(**base)


def _log(run: Path, event: str) -> list[dict]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


@pytest.mark.slow
def test_training_learns_and_evaluates(data: Path, tmp_path: Path) -> None:
    summary = train(_config(data, tmp_path / "run", epochs=2), progress=False)
    losses = [r["loss"] for r in _log(tmp_path / "run", "train")]
    assert summary["steps"] == len(losses) == 2 * (24_000 // 256)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.05
    teacher = summary["teacher_auc"]["validation"]
    # a model of the teacher's form gets half the way to the teacher's own AUC in 2 epochs of
    # 24k rows (measured 0.657 against a teacher of 0.778: 0.56 of the way)
    assert summary["validation"]["auc"] > 0.5 + 0.5 * (teacher - 0.5), (summary, teacher)
    assert summary["validation"]["num_examples"] == 3000
    assert set(summary["phase_fraction"]) == {"data", "forward", "backward", "optimizer"}
    test = evaluate_checkpoint(tmp_path / "run", split="test")
    assert test["num_examples"] == 3000 and test["auc"] > 0.6


def test_pipelined_equals_plain(data: Path, tmp_path: Path) -> None:
    a = train(_config(data, tmp_path / "a", max_steps=15), progress=False)
    b = train(_config(data, tmp_path / "b", max_steps=15, pipelined=False), progress=False)
    assert [r["loss"] for r in _log(tmp_path / "a", "train")] == \
        [r["loss"] for r in _log(tmp_path / "b", "train")]
    assert a["validation"] == b["validation"]


@pytest.mark.slow
def test_resume_equals_uninterrupted(data: Path, tmp_path: Path) -> None:
    # 93 steps per epoch: the resumed run crosses an epoch boundary
    full = train(_config(data, tmp_path / "full", max_steps=110, epochs=2), progress=False)
    train(_config(data, tmp_path / "cut", max_steps=80, epochs=2, save_every=40),
          progress=False)
    resumed = train(_config(data, tmp_path / "cut", max_steps=110, epochs=2, resume=True),
                    progress=False)
    full_losses = {r["step"]: r["loss"] for r in _log(tmp_path / "full", "train")}
    cut_losses = {r["step"]: r["loss"] for r in _log(tmp_path / "cut", "train")}
    assert min(s for s in cut_losses if s > 80) == 81
    for step in range(81, 111):
        assert cut_losses[step] == pytest.approx(full_losses[step], rel=1e-6, abs=1e-7), step
    assert resumed["validation"]["auc"] == pytest.approx(full["validation"]["auc"], abs=1e-7)
    assert resumed["trained_steps"] == 30
    # saved at 40, 80 (and validated there: the first run's end), at the epoch end's validation
    # (93) and at the end (110); --keep-checkpoints 2 keeps the newest two, and the best
    best = (tmp_path / "cut" / "checkpoints" / "best").read_text().strip()
    assert best in ("step_00000080", "step_00000093", "step_00000110")
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step_*")) == sorted(
        {"step_00000093", "step_00000110", best})


def test_a_failed_background_save_stops_the_run_with_its_error(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--background-checkpoints: a write that fails in the thread (a full disk) is raised on
    the training thread at the next save or at the end; the newest complete checkpoint stays."""
    run = tmp_path / "run"
    train(_config(data, run, max_steps=5, background_checkpoints=True), progress=False)
    first = latest_checkpoint(run / "checkpoints")
    assert first is not None and first.name == "step_00000005"

    def crash(path: str, *_: object, **__: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(app_checkpoint.dcp_checkpoint, "save_state", crash)
    with pytest.raises(OSError, match="disk full"):
        train(_config(data, run, max_steps=8, resume=True, background_checkpoints=True),
              progress=False)
    assert latest_checkpoint(run / "checkpoints") == first


def test_checkpoint_crash_during_save_keeps_previous(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    train(_config(data, run, max_steps=5), progress=False)
    first = latest_checkpoint(run / "checkpoints")
    assert first is not None and first.name == "step_00000005"

    def crash(path: str, *_: object, **__: object) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(app_checkpoint.dcp_checkpoint, "save_state", crash)  # what writes
    with pytest.raises(OSError, match="disk full"):
        train(_config(data, run, max_steps=8, resume=True), progress=False)
    assert latest_checkpoint(run / "checkpoints") == first  # the partial one is never used
    assert (run / "checkpoints" / "step_00000008.partial").is_dir()
    monkeypatch.undo()
    summary = train(_config(data, run, max_steps=8, resume=True), progress=False)
    assert summary["trained_steps"] == 3
    assert latest_checkpoint(run / "checkpoints").name == "step_00000008"
    assert not (run / "checkpoints" / "step_00000008.partial").exists()


def test_lr_schedule_by_hand() -> None:
    assert [lr_scale(s, 4, 0, 0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # decay over 4 steps from step 10: ((4 - done) / 4) ** 2, then the floor
    assert [lr_scale(s, 0, 10, 4) for s in (9, 10, 11, 12, 13, 14, 20)] == \
        [1.0, 1.0, 0.5625, 0.25, 0.0625, MIN_LR_SCALE, MIN_LR_SCALE]


def test_learning_rate_reaches_the_fused_kernel(data: Path, tmp_path: Path) -> None:
    # warm-up from 0: a first step at lr 0 * ... must not move the tables at all
    summary = train(_config(data, tmp_path / "run", max_steps=1, lr_warmup_steps=1_000_000,
                            embedding_optimizer=EmbeddingOptimizer.SGD), progress=False)
    assert summary["steps"] == 1
    untrained = train(_config(data, tmp_path / "zero", max_steps=1, lr_warmup_steps=1_000_000,
                              embedding_optimizer=EmbeddingOptimizer.SGD, embedding_learning_rate=1e9),
                      progress=False)
    # lr scale 1e-6 * 1e9 = 1e3 moves tables far: the validation metrics differ from lr 0.1's
    assert untrained["validation"]["logloss"] != summary["validation"]["logloss"]


def test_config_round_trip_and_strict_keys(tmp_path: Path) -> None:
    config = _config(Path("d"), Path("o"), max_steps=3)
    config.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == config
    with pytest.raises(ValueError, match="unknown key"):
        TrainConfig.from_json_dict({**config.to_json_dict(), "learning_rat": 1.0})
    with pytest.raises(ValueError, match="--batch-size must be a positive int"):
        _config(Path("d"), Path("o"), batch_size=0)


def test_bad_batch_size_is_a_clear_error(data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fewer than --batch-size"):
        train(_config(data, tmp_path / "run", batch_size=10**6), progress=False)


def test_same_seed_same_run(data: Path, tmp_path: Path) -> None:
    a = train(_config(data, tmp_path / "a", max_steps=5, seed=7), progress=False)
    b = train(_config(data, tmp_path / "b", max_steps=5, seed=7), progress=False)
    c = train(_config(data, tmp_path / "c", max_steps=5, seed=8), progress=False)
    assert a["validation"] == b["validation"] != c["validation"]
    assert torch.get_num_threads() >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_training_matches_cpu(data: Path, tmp_path: Path, amp: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (one process, the device the trainer picks where CUDA is): one seed, one initial
    model (the dense layers are drawn on the CPU whatever the device), so in fp32 every step's
    loss and the validation AUC are the CPU run's to float rounding; close with bf16."""
    import dlrm_app.training.trainer as train_module

    picked: list[torch.device] = []
    original = train_module.init_distributed

    def spy(*args: object, **kwargs: object) -> torch.device:
        picked.append(original(*args, **kwargs))
        return picked[-1]

    monkeypatch.setattr(train_module, "init_distributed", spy)
    gpu = train(_config(data, tmp_path / "gpu", max_steps=20, amp=amp), progress=False)
    assert picked == [torch.device("cuda", 0)]
    monkeypatch.setattr(train_module, "init_distributed", lambda *_a, **_k: torch.device("cpu"))
    cpu = train(_config(data, tmp_path / "cpu", max_steps=20, amp=False), progress=False)
    tolerance = 5e-3 if amp else 1e-4
    assert gpu["validation"]["auc"] == pytest.approx(cpu["validation"]["auc"], abs=tolerance)
    gpu_losses = [r["loss"] for r in _log(tmp_path / "gpu", "train")]
    cpu_losses = [r["loss"] for r in _log(tmp_path / "cpu", "train")]
    assert len(gpu_losses) == len(cpu_losses) == 20
    # the first step reads the initial model: the same on both devices, whatever the precision
    assert gpu_losses[0] == pytest.approx(cpu_losses[0], abs=2e-3 if amp else 1e-5)
    if not amp:
        assert gpu_losses == pytest.approx(cpu_losses, abs=1e-5)


def test_early_stop_at_target_auc_and_saved_plan(data: Path, tmp_path: Path) -> None:
    first = train(_config(data, tmp_path / "a", epochs=3, validate_every=10, target_auc=0.55),
                  progress=False)
    assert first["stopped_early"] and first["validation"]["auc"] >= 0.55
    assert first["steps"] % 10 == 0 and first["steps"] < 3 * 93
    validations = _log(tmp_path / "a", "validation")
    assert validations[-1]["step"] == first["steps"]
    assert all(v["auc"] < 0.55 for v in validations[:-1])  # it stopped at the first success
    # the saved plan reproduces the run exactly
    again = train(_config(data, tmp_path / "b", epochs=3, validate_every=10, target_auc=0.55,
                          plan=str(tmp_path / "a" / "plan.json")), progress=False)
    assert again["validation"] == first["validation"]
    with pytest.raises(ValueError, match="cannot read a sharding plan"):
        train(_config(data, tmp_path / "c", plan=str(tmp_path / "missing.json")), progress=False)


def test_evaluate_refuses_a_differently_encoded_dataset(data: Path, tmp_path: Path) -> None:
    train(_config(data, tmp_path / "run", max_steps=2), progress=False)
    other = tmp_path / "other"
    generate(other, rows=3000, num_dense=4, cardinalities=[500, 2000, 50, 999],
             pooling_factors=[1.0, 1.0, 3.0, 1.0], seed=1, row_group_size=256)
    with pytest.raises(ValueError, match="other sparse features or table sizes"):
        evaluate_checkpoint(tmp_path / "run", split="test", data=str(other))
    same_encoding = tmp_path / "same"
    generate(same_encoding, rows=3000, num_dense=4, cardinalities=[500, 2000, 50, 1000],
             pooling_factors=[1.0, 1.0, 3.0, 1.0], seed=1, row_group_size=256)
    result = evaluate_checkpoint(tmp_path / "run", split="test", data=str(same_encoding))
    assert result["num_examples"] == 300


@pytest.mark.slow
def test_tables_beyond_the_memory_budget_train_from_disk_to_the_same_model(tmp_path: Path) -> None:
    # One table of 100,000 rows (3.6 MB with row-wise Adagrad) and two small ones, and their wide
    # part's dim-1 tables (0.8 MB for the large one); with 4 MB per rank the planner keeps the
    # large one in a file behind a cache of a share of its rows (a dim-1 table stays in memory:
    # a cache's bookkeeping takes more per row than its 8 bytes)
    data = tmp_path / "data"
    generate(data, rows=8_000, num_dense=4, cardinalities=[100_000, 50, 1000],
             pooling_factors=[1.0, 3.0, 1.0], zipf_alpha=1.05, seed=0, rows_per_shard=4_000,
             row_group_size=256)
    memory = train(_config(data, tmp_path / "memory", max_steps=30, validate_every=15),
                   progress=False)
    budget_gib = 4e6 / 2**30
    disk = train(_config(data, tmp_path / "disk", max_steps=30, validate_every=15,
                         memory_per_rank=budget_gib), progress=False)
    plan = json.loads((tmp_path / "disk" / "plan.json").read_text())
    kernels = {name: ps["compute_kernel"] for module in plan.values() for name, ps in module.items()}
    assert kernels == {"t_cat_0": "fused_uvm_caching", "t_cat_1": "fused", "t_cat_2": "fused",
                       "w_cat_0": "fused", "w_cat_1": "fused", "w_cat_2": "fused"}
    (cache,) = [ps["cache_params"] for module in plan.values() for ps in module.values()
                if ps["cache_params"]]
    assert 0.05 < cache["load_factor"] < 0.5, cache
    assert [r["loss"] for r in _log(tmp_path / "disk", "train")] == \
        [r["loss"] for r in _log(tmp_path / "memory", "train")]
    assert disk["validation"] == memory["validation"]
    # the best checkpoint of the offloaded run evaluates like the in-memory one, and the
    # backing files are gone once training ended
    on_disk, in_memory = (evaluate_checkpoint(tmp_path / run, split="test")
                           for run in ("disk", "memory"))
    best = Path(in_memory.pop("checkpoint")).name
    assert Path(on_disk.pop("checkpoint")).name == best and best.startswith("step_")
    assert on_disk == in_memory
    assert list((tmp_path / "disk" / "offload").iterdir()) == []
    assert not (tmp_path / "memory" / "offload").exists()  # made only for tables on disk
    # --no-offload turns the same budget into the planner's error naming the flags
    with pytest.raises(ValueError, match="--memory-per-rank") as e:
        train(_config(data, tmp_path / "refused", max_steps=2, memory_per_rank=budget_gib,
                      offload=False), progress=False)
    assert "drop `--no-offload`" in str(e.value)


@pytest.mark.slow
def test_bf16_fast_path_keeps_the_auc_of_fp32(data: Path, tmp_path: Path) -> None:
    """--amp on CPU: bf16 autocast of the MLPs and interaction changes the computation (other
    losses) but not the model's quality: validation AUC within 0.002 of fp32 (measured 0.0003)."""
    fp32 = train(_config(data, tmp_path / "fp32", epochs=2, amp=False), progress=False)
    bf16 = train(_config(data, tmp_path / "bf16", epochs=2, amp=True), progress=False)
    assert (fp32["amp"], bf16["amp"]) == (False, True)
    losses = [[r["loss"] for r in _log(tmp_path / run, "train")] for run in ("fp32", "bf16")]
    assert losses[0] != losses[1]  # autocast really ran
    assert abs(bf16["validation"]["auc"] - fp32["validation"]["auc"]) <= 0.002, (bf16, fp32)


def test_amp_default_is_on_where_the_device_has_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrm_app.training import runtime

    cpu, detect = torch.device("cpu"), runtime.cpu_has_native_bf16.__wrapped__
    assert runtime.amp_enabled(cpu, True) and not runtime.amp_enabled(cpu, False)
    for native in (True, False):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda native=native: native)
        assert runtime.amp_enabled(cpu, None) is native
        assert isinstance(runtime.autocast(cpu, None), torch.autocast) is native
        # --amp asked for where bf16 is emulated: warned, with the flag that fixes it
        warning = runtime.amp_warning(cpu, True)
        assert (warning is None) is native
        if warning is not None:
            assert "--amp" in warning and "--no-amp" in warning
        assert runtime.amp_warning(cpu, None) is None and runtime.amp_warning(cpu, False) is None
    flags = Path("/proc/cpuinfo")
    if flags.exists():
        text = flags.read_text()
        expected = " avx512_bf16" in text or " amx_bf16" in text
        assert detect() is expected


def test_comm_precision_auto_is_bf16_only_where_it_changes_no_value_across_hosts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dlrm_app.model import Interaction, ModelConfig
    from dlrm_app.training import build, runtime
    from dlrm_app.training.config import CommPrecision, TrainConfig

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    cpu = torch.device("cpu")

    def resolved(hosts: int, **kwargs: object) -> CommPrecision:
        config = TrainConfig.from_flags(data=str(tmp_path), out=str(tmp_path / "run"), **kwargs)
        return build.comm_precision(config.parallel, config.model, cpu, hosts)

    assert resolved(2) is CommPrecision.BF16  # amp auto (on: native bf16), dot, 2 hosts
    assert resolved(1) is CommPrecision.FP32  # one host: loopback, the casts do not pay
    assert resolved(2, amp=False) is CommPrecision.FP32  # fp32 dense: bf16 would round
    dcn = ModelConfig(interaction=Interaction.DCN)
    assert resolved(2, model=dcn) is CommPrecision.FP32  # DCN multiplies them in fp32
    assert build.world_hosts() == 1
    assert resolved(1, comm_precision=CommPrecision.FP16) is CommPrecision.FP16  # as asked
    assert build.comm_codecs(CommPrecision.FP32) is None
    registry = build.comm_codecs(CommPrecision.BF16)
    codecs = registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward.quantized_dtype == codecs.backward.quantized_dtype == torch.bfloat16
    # row-wise partial sums are added in fp32: only finished values are rounded
    assert set(registry) == {"POOLED_EMBEDDINGS_ALL_TO_ALL"}
    # config.json round trip, and an older run's config (no key) reads as auto
    config = TrainConfig.from_flags(data="d", out="o", comm_precision=CommPrecision.BF16)
    assert TrainConfig.from_json_dict(config.to_json_dict()) == config
    old = flatten(config.to_json_dict())  # the flat form of the releases before sections
    del old["comm_precision"]
    assert TrainConfig.from_json_dict(old).parallel.comm_precision is CommPrecision.AUTO


@pytest.mark.parametrize("flag, kernel", [("sgd", "EXACT_SGD"), ("adagrad", "EXACT_ADAGRAD"),
                                          ("rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD")])
def test_embedding_optimizer_flag_reaches_the_kernel_typed(flag: str, kernel: str,
                                                           tmp_path: Path) -> None:
    from dlrm_app.training.build import fused_optimizer
    from dlrm_app.training.config import EmbeddingOptimizer, TrainConfig
    from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig

    config = TrainConfig.from_flags(data=str(tmp_path), out=str(tmp_path / "run"),
                                    embedding_optimizer=EmbeddingOptimizer(flag),
                                    embedding_learning_rate=0.07, embedding_eps=1e-4, eps=1e-6)
    # the tables take --embedding-eps; --eps is the MLPs' optimizer's
    assert fused_optimizer(config.optimizer) == FusedOptimizerConfig(
        optimizer=EmbOptimType[kernel], learning_rate=0.07, eps=1e-4)


def test_an_old_runs_eps_stays_its_tables_eps(tmp_path: Path) -> None:
    import json

    from dlrm_app.cli import build_parser, config_from_args

    # a config.json saved before --embedding-eps (and before the wide part): its --eps was
    # the tables' too, and its model had no wide part
    old = flatten(TrainConfig.from_flags(data="d", out="o", eps=1e-6).to_json_dict())
    del old["embedding_eps"]
    del old["model"]["wide"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = TrainConfig.load(tmp_path / "config.json")
    assert loaded.optimizer.embedding_eps == loaded.optimizer.eps == 1e-6
    assert loaded.model.wide is False
    assert TrainConfig.from_flags(data="d", out="o").optimizer.embedding_eps == 1e-2
    assert TrainConfig.from_flags(data="d", out="o").model.wide is True
    # on the command line --eps alone leaves the tables' epsilon at its default
    args = build_parser().parse_args(["train", "--data", "d", "--out", "o", "--eps", "1e-7"])
    given = config_from_args(args)
    assert (given.optimizer.eps, given.optimizer.embedding_eps, given.model.wide) == (
        1e-7, 1e-2, True)
    args = build_parser().parse_args(["train", "--data", "d", "--out", "o", "--no-wide"])
    assert config_from_args(args).model.wide is False
    with pytest.raises(ValueError, match="--embedding-eps must be > 0"):
        TrainConfig.from_flags(data="d", out="o", embedding_eps=0.0)


@pytest.mark.parametrize("eps", [1e-8, 1e-2])
def test_embedding_eps_damps_a_rarely_seen_rows_step(eps: float, tmp_path: Path) -> None:
    """Row-wise Adagrad moves a row by lr * g / (sqrt(mean(g^2)) + eps) on its first update
    (FBGEMM's definition): with eps 1e-8 a row seen once takes a full lr-sized step whatever its
    gradient's size; with the default 1e-2 a small gradient gives a small step, a large one
    almost the full step."""
    from dlrm_app.training.build import fused_optimizer
    from recsys_core.modules.embedding_configs import EmbeddingBagConfig
    from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from recsys_core.sparse import KeyedJaggedTensor

    config = TrainConfig.from_flags(data=str(tmp_path), out=str(tmp_path / "r"), embedding_eps=eps)
    kernel = fused_optimizer(config.optimizer)
    ebc = FusedEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3,
                                   feature_names=["f"])],
        optimizer_type=kernel.optimizer,
        optimizer_kwargs={"learning_rate": kernel.learning_rate, "eps": kernel.eps})
    weight = ebc.state_dict()["embedding_bags.t.weight"]
    before = weight.clone()
    # row 1 once with a small gradient, row 2 once with a large one
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    scale = torch.tensor([[1e-3], [1.0]])
    direction = torch.tensor([1.0, -2.0, 0.5, 3.0])
    (ebc(kjt).values() * scale * direction).sum().backward()
    after = ebc.state_dict()["embedding_bags.t.weight"]
    lr = config.optimizer.embedding_learning_rate
    for row, s in ((1, 1e-3), (2, 1.0)):
        g = s * direction
        expected = before[row] - lr * g / ((g ** 2).mean().sqrt() + eps)
        torch.testing.assert_close(after[row], expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(after[0], before[0])  # untouched
    full = lr * direction.norm() / direction.pow(2).mean().sqrt()  # the step with eps -> 0
    small, large = ((after[r] - before[r]).norm() / full for r in (1, 2))
    if eps == 1e-8:
        assert small > 0.99 and large > 0.99
    else:  # rms(g) 0.0019 against eps 0.01: 16% of the step; rms 1.9: 99%
        assert small < 0.2 and large > 0.95


def test_each_model_is_planned_for_the_batch_it_runs(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Training plans for its batch size, `evaluate` for its own (--batch-size 8192 by default,
    not the run's), and a config with no batch size yet for the planner's default (TorchRec's
    512)."""
    from dlrm_app.training import build

    train(_config(data, tmp_path / "run", max_steps=2), progress=False)
    planned: list[int] = []
    real = build.plan_for_env
    monkeypatch.setattr(build, "plan_for_env",
                        lambda *a, **k: planned.append(k["batch_size"]) or real(*a, **k))
    evaluate_checkpoint(tmp_path / "run", split="validation", batch_size=1000)
    train(_config(data, tmp_path / "again", max_steps=1), progress=False)
    cpu = torch.device("cpu")
    build.build_model(_config(data, tmp_path / "x", batch_size=None), DatasetSpec.load(data), cpu)
    assert planned == [1000, 256, 512]


def test_the_checkpointer_saves_and_restores_the_parts_it_is_given(tmp_path: Path) -> None:
    from dlrm_app.training.components import Checkpointer, TrainState
    from dlrm_app.training.config import CheckpointConfig

    model = torch.nn.Linear(2, 1)

    class Position:
        def __init__(self) -> None:
            self.rows = 0

        def state_dict(self) -> dict:
            return {"rows": self.rows}

        def load_state_dict(self, state: dict) -> None:
            self.rows = int(state["rows"])

    state, position = TrainState(step=7, epoch=1, epoch_batches=3, best_auc=0.7, best_step=5),\
        Position()
    position.rows = 42
    parts = {"train_state": state, "data": position}
    checkpointer = Checkpointer(tmp_path, model, None, parts, CheckpointConfig())
    checkpointer.save(state)
    restored, again = TrainState(), Position()
    parts = {"train_state": restored, "data": again}
    path = Checkpointer(tmp_path, model, None, parts, CheckpointConfig()).restore()
    assert path is not None and path.name == "step_00000007"
    assert (restored, again.rows) == (TrainState(step=7, epoch=1, epoch_batches=3, best_auc=0.7,
                                                 best_step=5), 42)
    # the parts make one flat record, as checkpoints always had: a key twice is an error
    with pytest.raises(ValueError, match="repeats the keys"):
        Checkpointer(tmp_path, model, None, {"a": state, "b": TrainState()},
                     CheckpointConfig()).save(state)
