"""The heterogeneity benchmark's helpers: the no-communication bound, the workers' command line, the loss
window, the CPU accounting, and the cnn task's data and model."""

import inspect

import pytest
import torch

from benchmarks import harness, heterogeneity
from benchmarks.imbalance import report
from lightning_partial import ABSSGDStrategy

pytestmark = pytest.mark.timeout(120)


def _rank(t_start: float, step_times: list[float], *, batch: int, t_end: float) -> dict:
    return {"t_start": t_start, "t_end": t_end, "samples": batch * len(step_times), "batches": len(step_times),
            "trace": [(t - t_start, 1.0, batch) for t in step_times]}


def test_the_bound_counts_only_the_window_in_which_every_rank_trains():
    # A fast rank steps at 0, 0.1, ..., 1.0; a slow one at 0, 0.5, ..., 4.5 and goes on alone after 1 s.
    fast = _rank(0.0, [i / 10 for i in range(11)], batch=8, t_end=1.2)
    slow = _rank(0.0, [i / 2 for i in range(10)], batch=8, t_end=5.0)
    # Window [0, 1): the fast rank's 10 steps and the slow rank's steps at 0 and 0.5.
    assert heterogeneity.concurrent_speed([fast, slow]) == pytest.approx((10 + 2) * 8 / 1.0)
    # The earlier definition counts the slow rank's lone seconds: 88/1.2 + 80/5.
    assert heterogeneity.own_interval_speed([fast, slow]) == pytest.approx(88 / 1.2 + 16)


def test_the_bound_window_starts_at_the_last_rank_to_step_and_must_exist():
    early = _rank(0.0, [0.0, 1.0, 2.0, 3.0, 4.0], batch=4, t_end=4.5)
    late = _rank(2.0, [2.0, 3.0, 4.0], batch=4, t_end=4.5)
    assert heterogeneity.concurrent_speed([early, late]) == pytest.approx(4 * 4 / 2.0)  # [2, 4): two steps each
    apart = _rank(5.0, [5.0, 6.0], batch=4, t_end=6.5)
    with pytest.raises(ValueError, match="no interval in which every rank trained"):
        heterogeneity.concurrent_speed([early, apart])


@pytest.mark.parametrize("argv", [
    [],
    ["--model", "mlp", "--seed", "3", "--interval", "0.03", "--abs-lr", "0.25", "--abs-batch-size", "64",
     "--reference-samples", "512", "--adaptive", "--thread-cpu", "--momentum", "0.9", "--optimizer", "adamw",
     "--speed", "1,0.5", "--device-ms-per-sample", "0.5", "--window", "3",
     "--first-window", "3"],
    ["--target-samples", "256", "--reference-samples", "none", "--step-samples", "1024", "--momentum", "0",
     "--no-weight-prediction", "--staleness-rule", "none", "--lr-schedule", "cosine"],
])
def test_the_workers_get_every_option_the_parent_has(argv):
    parent = heterogeneity.build_parser().parse_args(argv)
    parent.lr = heterogeneity.DEFAULT_LR[parent.model]  # as main() resolves it
    command = heterogeneity.worker_command(parent, "abs_sgd")
    assert command[1:3] == ["-m", heterogeneity.__name__]  # this module, run from the repository root
    worker = heterogeneity.build_parser().parse_args(command[3:])
    assert worker.run == "abs_sgd"
    for key, value in vars(parent).items():
        if key not in ("run", "repeats", "out", "max_steal", "steal_retries"):
            assert getattr(worker, key) == value, key


def test_the_fastest_ranks_wait_share_splits_off_the_rounds_before_the_first_split():
    from lightning_partial.callbacks import AdaptiveBatchSize

    run = {"wall_s": 10.0, "round_wait_s": [2.0, 1.0, 0.5, 0.0], "round_wait_start_s": [1.0, 0.6, 0.2, 0.0]}
    shares = heterogeneity.fast_wait_shares(run, [1.0, 1.0, 0.5, 0.25])  # the two ranks at speed 1
    assert shares == {"abs_fast_wait_share": pytest.approx(0.15), "abs_fast_wait_start_share": pytest.approx(0.08)}
    ddp = {"wall_s": 10.0, "round_wait_s": [None] * 4, "round_wait_start_s": [None] * 4}
    assert heterogeneity.fast_wait_shares(ddp, [1.0, 1.0, 0.5, 0.25]) == {
        "abs_fast_wait_share": None, "abs_fast_wait_start_share": None}
    callback = AdaptiveBatchSize(window=8)
    assert heterogeneity.start_rounds([callback]) is None  # no split yet
    callback.history.append((7, (128,) * 4, (1,) * 4, False))  # an update that is no split (asynchronous rounds)
    callback.history.append((9, (44, 38, 29, 17), (4, 4, 4, 4), True))  # the first split, at round 9's result
    assert heterogeneity.start_rounds([object(), callback]) == 10  # round 10's batches were fetched before it
    assert heterogeneity.start_rounds([]) is None


def test_the_emulated_device_sleeps_its_time_per_sample_over_the_ranks_speed_and_refuses_bad_input():
    from types import SimpleNamespace

    from benchmarks import harness

    device = harness.emulated_device(0.002, (1.0, 0.25))
    device.setup(SimpleNamespace(global_rank=1), None, "fit")
    for samples in (10, 6):  # a micro-batch's own size (AdaptiveBatchSize changes it between batches)
        device.on_train_batch_start(None, None, (torch.zeros(samples, 3), torch.zeros(samples)), 0)
        device.on_after_backward(None, None)
    assert device.slept_s == pytest.approx(0.002e-3 * (10 + 6) / 0.25)
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            heterogeneity.build_parser().parse_args(["--device-ms-per-sample", bad])


def test_the_imbalance_workers_get_every_option_the_parent_has(tmp_path):
    from benchmarks.imbalance import runner

    parent = runner.parse_args(["--steps", "7", "--batch-size", "64", "--seed", "2", "--width", "32", "--depth", "2",
                                "--lr", "0.125", "--momentum", "0.5", "--optimizer", "adamw", "--schedule", "constant",
                                "--localsgd-warmup", "3", "--averaging-period", "2", "--digest-steps", "5",
                                "--threads", "2", "--device-ms-per-sample", "0.25", "--step-pieces",
                                "--workdir", str(tmp_path)])
    command = runner.worker_command("eager_sgd_imbalanced", "t.0", parent, 12.5)
    assert command[1:3] == ["-m", "benchmarks.imbalance"]
    worker = runner.parse_args(command[3:])
    assert (worker.run, worker.tag, worker.delay_ms) == ("eager_sgd_imbalanced", "t.0", 12.5)
    for key, value in vars(parent).items():
        if key not in ("run", "tag", "delay_ms", "repeats", "only", "out", "timeout", "keep_workdir", "max_steal",
                       "steal_retries"):
            assert getattr(worker, key) == value, key


def test_the_imbalance_benchmark_runs_catch_up_fits_by_samples_at_a_constant_rate(tmp_path):
    from benchmarks.imbalance import runner
    from benchmarks.imbalance.configs import CONFIGS
    from benchmarks.imbalance.worker import catches_up

    assert catches_up(CONFIGS["eager_sgd_catch_up_s3_imbalanced"])
    assert not catches_up(CONFIGS["eager_sgd_imbalanced"]) and not catches_up(CONFIGS["abs_sgd_imbalanced"])
    # Their rounds per sample are not known in advance: a schedule over --steps would not fit them.
    with pytest.raises(SystemExit, match="need --schedule constant"):
        runner.run_parent(runner.parse_args(["--only", "eager_sgd_catch_up_s3_imbalanced", "--workdir", str(tmp_path)]))
    # Every configuration's worker gets the straggler's timing.
    args = runner.parse_args(["--straggle-at", "backward", "--workdir", str(tmp_path)])
    command = runner.worker_command("ddp_imbalanced", "t", args, 10.0)
    assert command[command.index("--straggle-at") + 1] == "backward"


def test_the_imbalance_benchmark_gives_abs_sgd_the_others_samples_in_whole_epochs(tmp_path):
    from benchmarks.imbalance import runner
    from benchmarks.imbalance.worker import abs_sgd_epochs

    assert abs_sgd_epochs(256, 384) == 3  # 256 x 4 x 384 = 3 x 131,072
    assert abs_sgd_epochs(256, 128) == 1
    with pytest.raises(ValueError, match="--steps a multiple of 256"):
        abs_sgd_epochs(250, 384)
    # The parent refuses before any fit starts.
    with pytest.raises(SystemExit, match="whole epochs"):
        runner.run_parent(runner.parse_args(["--only", "abs_sgd_imbalanced", "--workdir", str(tmp_path)]))
    # Its batches are micro-batches: replicas are judged at the end of fit only.
    from benchmarks.imbalance.configs import CONFIGS
    from benchmarks.imbalance.report import _replica_check

    ranks = [{"digests": [1.0, float(r)], "final_digest": 5.0} for r in range(4)]
    assert _replica_check(CONFIGS["abs_sgd_imbalanced"], ranks, runner.parse_args([]))["ok"]
    ranks[3]["final_digest"] = 5.5
    assert not _replica_check(CONFIGS["abs_sgd_imbalanced"], ranks, runner.parse_args([]))["ok"]


def test_the_wagma_replica_check_follows_the_global_period_the_fit_ran():
    from benchmarks.imbalance import runner
    from benchmarks.imbalance.configs import CONFIGS
    from benchmarks.imbalance.report import _replica_check

    def ranks(tau: int, recorded: int | None) -> list[dict]:  # identical after every tau-th step, apart otherwise
        records = [{"digests": [0.0 if (i + 1) % tau == 0 else float(r + i) for i in range(20)], "final_digest": 1.0}
                   for r in range(4)]
        for record in records:
            if recorded is not None:
                record["global_every"] = recorded  # what the worker keeps
        return records

    args = runner.parse_args([])
    wagma = CONFIGS["wagma_sgd_imbalanced"]
    assert _replica_check(wagma, ranks(5, 5), args)["ok"]
    assert not _replica_check(wagma, ranks(10, 5), args)["ok"]
    assert _replica_check(CONFIGS["wagma_sgd_global10_imbalanced"], ranks(10, 10), args)["ok"]
    assert not _replica_check(CONFIGS["wagma_sgd_global10_imbalanced"], ranks(5, 10), args)["ok"]
    assert _replica_check(wagma, ranks(10, None), args)["ok"]  # a record from before the worker kept the period
    # The period is kept as a field (what the README's row names), not only in the rule's prose.
    assert _replica_check(wagma, ranks(5, 5), args)["global_every"] == 5
    assert "global_every" not in _replica_check(CONFIGS["ds_sync_imbalanced"], ranks(5, 5), args)


def test_the_replica_check_of_one_group_of_every_rank_follows_what_activates_its_rounds():
    from benchmarks.imbalance import runner
    from benchmarks.imbalance.configs import CONFIGS
    from benchmarks.imbalance.report import _replica_check

    def ok(name: str, identical_at: set[int], mode: str, group_size: int | None = 4,
           order: str = "step_then_average") -> bool:
        records = [{"digests": [0.0 if i in identical_at else float(r + i) for i in range(16)], "final_digest": 1.0,
                    "global_every": None, "average_every": 4, "mode": mode, "group_size": group_size, "order": order}
                   for r in range(4)]
        return _replica_check(CONFIGS[name], records, runner.parse_args([]))["ok"]

    # Synchronous rounds of every rank, every 4th step: identical after each round's step, apart between.
    assert ok("global_local4_sync_imbalanced", {3, 7, 11, 15}, "sync")
    assert not ok("global_local4_sync_imbalanced", {3, 7, 11}, "sync")  # a round that left them apart
    # Solo rounds: identical only after a round that found every rank fresh, never after a local step.
    assert ok("global_local4_imbalanced", {7}, "solo") and ok("global_local4_imbalanced", set(), "solo")
    assert not ok("global_local4_imbalanced", {5}, "solo")
    # Groups smaller than the world and no global period: never identical before the final average.
    assert not ok("wagma_sgd_local4_imbalanced", {7}, "solo", group_size=None)
    assert ok("wagma_sgd_local4_imbalanced", set(), "solo", group_size=None)
    # The average first, then the local step: even synchronous rounds leave the replicas apart after each step.
    assert ok("global_local4_sync_imbalanced", set(), "sync", order="average_then_step")
    assert not ok("global_local4_sync_imbalanced", {3, 7, 11, 15}, "sync", order="average_then_step")


def test_abs_sgd_runs_at_the_strategy_defaults_unless_told_and_bad_sample_options_fail():
    args = heterogeneity.build_parser().parse_args([])
    assert (args.target_samples, args.reference_samples, args.step_samples) == (None, "global_batch", "global_batch")
    defaults = inspect.signature(ABSSGDStrategy).parameters
    assert (args.step_boundary, args.final_sync) == (defaults["step_boundary"].default, defaults["final_sync"].default)
    assert args.delay == defaults["delay"].default == "auto"
    assert heterogeneity.build_parser().parse_args(["--delay", "0"]).delay == 0
    assert heterogeneity.default_lr(args) == 0.04  # plain SGD's 0.4 at momentum 0.9
    paper = heterogeneity.build_parser().parse_args(["--reference-samples", "none", "--step-samples", "none"])
    assert (paper.reference_samples, paper.step_samples) == (None, None)
    for bad in ("0", "-3", "global", "1.5"):
        with pytest.raises(SystemExit):
            heterogeneity.build_parser().parse_args(["--step-samples", bad])


def test_the_loss_curve_averages_the_same_samples_in_every_configuration():
    args = heterogeneity.build_parser().parse_args(["--abs-batch-size", "64"])
    assert heterogeneity.loss_window(args) == heterogeneity.WINDOW * 128
    trace = [(float(i), float(i), 8) for i in range(5)]  # equal batches: the mean of the last two
    assert heterogeneity.smoothed(trace, 16) == [(1.0, 0.5), (2.0, 1.5), (3.0, 2.5), (4.0, 3.5)]
    # Batches of varying size (AdaptiveBatchSize): as many samples, each loss weighted by its batch's samples.
    varying = [(0.0, 4.0, 8), (1.0, 1.0, 4), (2.0, 2.0, 4), (3.0, 0.0, 12)]
    assert heterogeneity.smoothed(varying, 16) == [(2.0, (32 + 4 + 8) / 16), (3.0, (0 + 8) / 16)]


def test_step_lags_pool_the_repeats_per_rank_and_share_the_samples_by_lag():
    fits = [[{"0": 8, "1": 8}, {"1": 4, "2": 4}], [{"0": 8}, {"2": 8}]]  # two repeats of two ranks (JSON keys)
    figures = heterogeneity.lag_figures(fits)
    assert figures["abs_step_lag_by_rank"] == pytest.approx([8 / 24, 28 / 16])
    assert figures["abs_step_lag_shares"] == pytest.approx([16 / 40, 12 / 40, 12 / 40])
    assert heterogeneity.lag_figures([[None, None]]) == {}  # not abs_sgd


def test_abs_sgd_fits_splits_its_arms_on_double_dashes_and_reads_seed_ranges():
    from benchmarks.abs_sgd_fits import arm_options, seed_range

    assert seed_range("0-3") == [0, 1, 2, 3] and seed_range("2,5") == [2, 5]
    assert arm_options([]) == [[]]  # the defaults
    assert arm_options(["--", "--adaptive"]) == [["--adaptive"]]
    assert arm_options(["--", "--", "--adaptive", "--", "--lr", "0.1"]) == [[], ["--adaptive"], ["--lr", "0.1"]]


def test_the_stability_model_reduces_to_its_uniform_delay_and_is_undelayed_when_all_is_on_time():
    from benchmarks import stability_model as m

    mu = 0.9
    for h in (0.05, 0.2, 0.5, 2.0):
        for rule in ("none", "spike"):  # every share one step late, no prediction: the uniform one-round delay
            assert m.lagged(rule, h, mu, [0.0, 1.0], "none") == pytest.approx(m.uniform(rule, h, mu, 1))
        assert m.lagged("none", h, mu, [1.0], "own") == pytest.approx(m.uniform("none", h, mu, 0))


def test_round_timing_measures_the_spread_from_arrivals_and_the_latency_from_waiting_ranks_only():
    # Two ranks, rounds 0-3, (arrived, handed, went_on); rank 1 goes on from rounds 1-3: its result comes with
    # its next deposit, a micro-batch (30 ms) after the round completed.
    rank0 = {"0": [0.000, 0.012, False], "1": [0.100, 0.112, False], "2": [0.200, 0.211, False],
             "3": [0.300, 0.310, False]}
    rank1 = {"0": [0.004, 0.012, False], "1": [0.106, 0.140, True], "2": [0.203, 0.240, True],
             "3": [0.305, 0.340, True]}
    timing = heterogeneity.round_timing([rank0, rank1])
    assert timing["rounds"] == 4 and timing["period_ms"] == pytest.approx(100.0)
    assert timing["arrival_spread_ms"] == pytest.approx(4.5)  # median of 4, 6, 3, 5
    assert timing["latency_ms"] == pytest.approx(7.0)  # rank 0's results after the last arrivals: 8, 6, 8, 5
    assert timing["went_on"] == pytest.approx(3 / 8)
    every = {q: [a, h + 0.02, True] for q, (a, h, _) in rank1.items()}
    assert heterogeneity.round_timing([every, every])["latency_ms"] is None  # nobody waited: no latency
    old = {q: [a, h] for q, (a, h, _) in rank0.items()}  # files from before the arrival marks
    assert heterogeneity.round_timing([old, old])["went_on"] == 0.0


def test_cpu_by_role_sums_each_role_between_snapshots_and_counts_new_threads_whole():
    first = {1: ("main", 1.0), 2: ("communication", 0.5)}
    last = {1: ("main", 3.0), 2: ("communication", 0.75), 3: ("other", 0.25)}
    assert harness.cpu_by_role(first, last) == {"main": 2.0, "communication": 0.25, "other": 0.25}
    here = harness.thread_cpu()
    assert any(role == "main" for role, _ in here.values()) and all(s >= 0 for _, s in here.values())
    by_name = harness.cpu_by_thread_name()  # the same threads' CPU, summed per kernel thread name
    assert by_name and sum(by_name.values()) == pytest.approx(sum(s for _, s in here.values()), abs=0.05)


def test_the_step_pieces_are_per_step_medians_over_the_ranks_and_absent_unless_measured():
    ranks = [{"steps": 10, "step_pieces": {"flatten": {"calls": 10, "cpu_s": 0.005}}},
             {"steps": 20, "step_pieces": {"flatten": {"calls": 20, "cpu_s": 0.03}, "store": {"calls": 5, "cpu_s": 0.002}}},
             {"steps": 10, "step_pieces": {"flatten": {"calls": 10, "cpu_s": 0.007}}}]
    assert report.step_pieces(ranks) == pytest.approx({"flatten": 0.7, "store": 0.0})  # ms per step
    assert report.step_pieces([{"steps": 1, "step_pieces": None}]) is None
    assert report.step_pieces([{"steps": 1}]) is None  # a record from before the option


def test_the_imbalance_cpu_parts_add_up_to_the_process_cpu_per_trained_sample():
    ranks = [
        {"samples": 100, "cpu_s": 1.0, "compute_cpu_s": 0.5, "thread_cpu_s": {"main": 0.7, "communication": 0.1}},
        {"samples": 300, "cpu_s": 2.0, "compute_cpu_s": 1.5, "thread_cpu_s": {"main": 1.7, "communication": 0.2}},
    ]
    parts = report.cpu_parts(ranks)
    assert parts == pytest.approx({"cpu_us_compute": 5000.0, "cpu_us_step": 1000.0,
                                   "cpu_us_communication": 750.0, "cpu_us_other": 750.0})
    assert sum(parts.values()) == pytest.approx(3.0 / 400 * 1e6)  # the whole process CPU, every thread
    legacy = report.cpu_parts([{"samples": 1, "cpu_s": 1.0}])  # a record from before the split
    assert set(legacy) == set(report.CPU_PARTS) and all(v != v for v in legacy.values())


def test_the_cnn_task_is_built_once_deterministic_and_buffer_free(tmp_path, monkeypatch):
    first = heterogeneity.image_task(3, 64, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["images.seed3.n64.pt"]  # no temporary file left

    import recipes.data.images

    def no_second_build(*args, **kwargs):
        raise AssertionError("the cached task was generated again")

    monkeypatch.setattr(recipes.data.images, "ClassImages", no_second_build)
    again = heterogeneity.image_task(3, 64, tmp_path)
    assert torch.equal(first["x_train"], again["x_train"]) and torch.equal(first["y_test"], again["y_test"])
    assert first["x_train"].shape == (64, 3, heterogeneity.IMAGE_SIZE, heterogeneity.IMAGE_SIZE)
    assert len(first["x_test"]) == heterogeneity.IMAGE_TEST_SAMPLES
    assert set(first["y_train"].tolist()) <= set(range(10))
    monkeypatch.undo()
    (tmp_path / "elsewhere").mkdir()
    fresh = heterogeneity.image_task(3, 64, tmp_path / "elsewhere")
    assert torch.equal(first["x_train"], fresh["x_train"])  # generated again, the same
    net = heterogeneity.build_cnn()
    assert not list(net.buffers())  # DDP would broadcast buffers at every step
    assert net(first["x_train"][:4]).shape == (4, 10)


def test_readme_result_tables_match_the_results_files():
    """README.md's generated tables are what benchmarks/results/*.json say (``results_table.py --check``)."""
    from benchmarks import results_table

    assert results_table.main(["--check"]) == 0, "run: python -m benchmarks.results_table"


def test_the_readme_labels_an_abs_sgd_run_by_what_differs_from_todays_defaults():
    """A heterogeneity file from before final_sync and step_boundary existed ran neither (no finish; steps ended at
    the first round reaching the global batch): its README row says so."""
    from benchmarks.results_table import ABS_SGD_DEFAULTS, abs_sgd_label
    from lightning_partial.callbacks import AdaptiveBatchSize

    defaults = inspect.signature(ABSSGDStrategy).parameters
    assert ABS_SGD_DEFAULTS == {key: defaults[key].default for key in ABS_SGD_DEFAULTS}
    assert abs_sgd_label({"final_sync": 0.05, "step_boundary": "nearest"}) == "`abs_sgd` (defaults)"
    assert abs_sgd_label({}) == "`abs_sgd` (`final_sync=0.0, step_boundary='at_least'`)"
    today = {"final_sync": 0.05, "step_boundary": "nearest"}
    # delay="auto": 0 with AdaptiveBatchSize or AdamW, 1 otherwise; a run records the value it resolved or was given.
    # AdaptiveBatchSize arrives by samples by default; a run from before its arrival option (absent) arrived by count.
    # overlap_arrival=True by default, for arrivals by samples or time; a run from before it (absent) waited.
    # AdaptiveBatchSize's first sizes after first_window=2 rounds by default; a run from before the benchmark's
    # --first-window (absent) made them after a whole window (8).
    filled = {**today, "adaptive": True, "arrival": "samples", "overlap_arrival": True, "window": 8,
              "first_window": None}
    assert abs_sgd_label({**filled, "delay": 0}) == "`abs_sgd` + `AdaptiveBatchSize` (defaults)"
    assert (AdaptiveBatchSize().window, AdaptiveBatchSize().first_window) == (8, 2)  # what the label calls them
    assert abs_sgd_label({**filled, "delay": 0, "first_window": 2}) == "`abs_sgd` + `AdaptiveBatchSize` (defaults)"
    before = {key: value for key, value in filled.items() if key not in ("window", "first_window")}
    assert abs_sgd_label({**before, "delay": 0}) == "`abs_sgd` + `AdaptiveBatchSize` (`first_window=8`)"
    assert abs_sgd_label({**filled, "delay": 0, "window": 2, "first_window": None}) == (
        "`abs_sgd` + `AdaptiveBatchSize` (`window=2`)")
    assert abs_sgd_label({**filled, "delay": 0, "overlap_arrival": False}) == (
        "`abs_sgd` + `AdaptiveBatchSize` (`overlap_arrival=False`)")
    assert ABSSGDStrategy().overlap_arrival is True  # what the label calls the default
    assert abs_sgd_label({**filled, "delay": 1}) == "`abs_sgd` + `AdaptiveBatchSize` (`delay=1`)"
    assert abs_sgd_label({**today, "adaptive": True, "delay": 0}) == (
        "`abs_sgd` + `AdaptiveBatchSize` (`arrival='count', first_window=8`)")
    assert abs_sgd_label({**filled, "arrival": "time", "delay": 0}) == (
        "`abs_sgd` + `AdaptiveBatchSize` (`arrival='time'`)")
    assert AdaptiveBatchSize().arrival == "samples"  # what the label calls the default
    assert abs_sgd_label({**today, "optimizer": "adamw", "delay": 0}) == "`abs_sgd` (defaults)"
    assert abs_sgd_label({**today, "delay": 0}) == "`abs_sgd` (`delay=0`)"


def test_the_readme_names_the_global_period_a_wagma_imbalance_run_used():
    """The README's wagma_sgd row states the period the fit ran: from its replica check (what the workers recorded),
    else from the configuration's label, else ``?``."""
    from benchmarks.results_table import wagma_period

    rule = "identical after every 5th step (global average, tau=5); within groups otherwise"
    assert wagma_period({"label": "WAGMA-SGD (S=2, tau=10)", "runs": [{"replica_check": {"rule": rule}}]}) == "5"
    assert wagma_period({"label": "WAGMA-SGD (S=2, tau=10)", "runs": []}) == "10"
    assert wagma_period({"label": "WAGMA-SGD (S=2, tau=12)"}) == "12"
    assert wagma_period({"label": "WAGMA-SGD"}) == "?"
    # Files written since the replica check records the period as a field: the field wins over the label.
    assert wagma_period({"label": "WAGMA-SGD (S=2, tau=5)", "runs": [{"replica_check": {"global_every": 10}}]}) == "10"
    assert wagma_period({"label": "WAGMA-SGD (S=2, tau=5)", "runs": [{"replica_check": {"global_every": None}}]}) == "none"


def _report(queue, value: int) -> None:  # type: ignore[no-untyped-def]
    queue.put(value)


def _die(code: int) -> None:
    raise SystemExit(code)


def test_process_reports_collects_one_per_process_and_fails_at_once_when_one_dies():
    """The benchmarks' parent waits for its processes' reports: one each when they all report; an error naming the
    process when one exits with an error (its peers would wait for it), long before the bound."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # the targets live in this test module
    queue = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(queue, i)) for i in range(3)]
    for p in procs:
        p.start()
    assert sorted(harness.process_reports(queue, procs, timeout=60.0)) == [0, 1, 2]
    for p in procs:
        p.join(timeout=10)

    queue = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(queue, 0)), ctx.Process(target=_die, args=(3,))]
    for p in procs:
        p.start()
    with pytest.raises(RuntimeError, match=r"process\(es\) \[1\] exited with \[3\]"):
        harness.process_reports(queue, procs, timeout=60.0)
    for p in procs:
        p.join(timeout=10)
