"""Sweeps: sweep files expand into validated trials (fast), and a real 2-trial sweep runs through Ray Tune
into one MLflow parent run with nested child runs (marked service)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from dmltrain.service.cli import parse_args
from dmltrain.service.config import ConfigError
from dmltrain.service.sweeps import load_sweep, run_sweep
from dmltrain.service.sweeps.driver import concurrent_trials
from dmltrain.service.sweeps.spec import run_name
from dmltrain.service.sweeps.summary import TrialResult
from dmltrain.service.sweeps.trial import BASELINE_TAG, TRIAL_TAG

REPO = Path(__file__).parents[1]


def test_summary_counts_the_steps_a_trial_trained_not_its_first_launchs_setting() -> None:
    """MLflow params keep the first launch's train.steps: a trial extended by a relaunch, or killed early,
    must be reported with the steps it logged (and the images those saw)."""

    def trial(history: dict[str, list[tuple[int, float]]]) -> TrialResult:
        params = {"train.steps": "20", "train.global_batch_size": "128"}
        return TrialResult("t", "r", "FINISHED", "trial", params, {}, history)

    extended = trial({"train/loss": [(10, 1.0), (20, 0.9), (30, 0.8)], "eval/test/recall_at_1": [(0, 0.1)]})
    assert (extended.row()["steps"], extended.row()["images_seen"]) == (30, 30 * 128)
    killed = trial({"train/loss": [(5, 1.0), (12, 0.9)]})
    assert (killed.row()["steps"], killed.row()["images_seen"]) == (12, 12 * 128)
    assert trial({}).row()["steps"] == 20  # nothing logged: the configured steps are all there is


def test_wall_time_leaves_out_the_idle_time_before_a_relaunch() -> None:
    """A trial stopped at 100 s and relaunched an hour later: MLflow's start-to-end span holds the hour."""
    from dmltrain.service.sweeps.summary import active_seconds

    metrics = [10_000, 50_000, 100_000, 3_700_000 + 20_000, 3_700_000 + 60_000]
    assert active_seconds(0, 3_700_000 + 65_000, [3_700_000], metrics) == 165.0
    assert active_seconds(0, 120_000, [], metrics[:3]) == 120.0  # one launch: the span
    assert active_seconds(0, None, [], metrics) is None  # never ended
    # Three launches, the middle one stopped (at 1,030 s) before it logged anything: its gap and the next
    # one were both measured back to the first launch's last metric (0.0 s in all). Now 100 s + 100 s (the
    # middle launch, which left no trace of how long it ran, counts as idle).
    metrics = [0, 100_000, 2_050_000]
    assert active_seconds(0, 2_100_000, [1_000_000, 2_000_000], metrics) == 200.0


def test_a_failed_trial_reports_its_reason() -> None:
    """Tune hands back a trial's error as the remote traceback: its first 500 characters held a process
    title and frames, not the reason (the refusal of a live driver, a config error)."""
    from ray.exceptions import RayTaskError

    from dmltrain.service.sweeps.driver import trial_error

    cause = ConfigError("run.name=s.a is being trained by another driver (vm pid 7, alive 3 s ago)")
    frames = "".join(f'  File "/x/{i}.py", line {i}, in f{i}\n    g()\n' for i in range(12))
    text = f"ray::ImplicitFunc.train() (pid=42)\nTraceback (most recent call last):\n{frames}{cause!r}"
    wrapped = RayTaskError("train", text, cause)
    for error in (wrapped, wrapped.as_instanceof_cause(), cause):
        assert trial_error(error) == f"ConfigError: {cause}", error


def test_trials_whose_run_names_would_collide_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "base": str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
                "variants": [{"name": "B 64", "overrides": {}}, {"name": "B_64", "overrides": {}}],
            }
        )
    )
    with pytest.raises(ConfigError, match=r"trials 'B 64' and 'B_64' get the same run.name 's.B_64'"):
        load_sweep(path)


def test_overrides_may_follow_options_on_the_command_line() -> None:
    args = parse_args(["sweep", "s.yaml", "a.b=1", "--name", "x", "train.steps=40", "--summary", "t.md"])
    assert (args.sweep, args.name, args.summary) == ("s.yaml", "x", "t.md")
    assert args.overrides == ["a.b=1", "train.steps=40"]
    with pytest.raises(SystemExit):  # still refused: an unknown option, or a stray word that is no override
        parse_args(["sweep", "s.yaml", "--nmae", "x"])
    with pytest.raises(SystemExit):
        parse_args(["sweep", "s.yaml", "--name", "x", "steps"])


def _write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _spec(**extra) -> dict:
    return {
        "name": "t",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "overrides": {"train.steps": 2},
        **extra,
    }


def test_variants_times_grid_replace_whole_sections(tmp_path: Path) -> None:
    sweep = load_sweep(
        _write(
            tmp_path / "s.yaml",
            _spec(
                variants=[
                    {"name": "fastap", "overrides": {"loss": {"name": "fastap", "num_bins": 20}}},
                    {"name": "smoothap", "overrides": {"loss": {"name": "smoothap"}}},
                ],
                grid={"train.global_batch_size": [64, 256]},
            ),
        ),
        ["train.log_every=1"],
    )
    labels = [t.label for t in sweep.trials]
    assert labels == [
        "fastap,global_batch_size=64",
        "fastap,global_batch_size=256",
        "smoothap,global_batch_size=64",
        "smoothap,global_batch_size=256",
    ]
    first = sweep.trials[0].config
    # the base's smoothap `temperature` is gone with its section, the grid and command line apply
    assert first.loss.name == "fastap" and first.loss.num_bins == 20
    assert first.train.global_batch_size == 64 and first.train.steps == 2 and first.train.log_every == 1
    assert len({t.config.run.name for t in sweep.trials}) == 4
    assert first.run.name == run_name("t", labels[0])


def test_a_grid_over_whole_sections_labels_them_by_what_differs(tmp_path: Path) -> None:
    """Two loss sections of the same name were refused as repeating labels, with advice about variants."""
    grid = {"loss": [{"name": "fastap", "num_bins": 10}, {"name": "fastap", "num_bins": 40}]}
    sweep = load_sweep(_write(tmp_path / "s.yaml", _spec(grid=grid)))
    assert [t.label for t in sweep.trials] == ["loss=name=fastap+num_bins=10", "loss=name=fastap+num_bins=40"]
    assert [t.config.loss.num_bins for t in sweep.trials] == [10, 40]
    named = {"loss": [{"name": "fastap"}, {"name": "smoothap"}]}  # distinct names: labelled by name alone
    assert [t.label for t in load_sweep(_write(tmp_path / "n.yaml", _spec(grid=named))).trials] == [
        "loss=fastap",
        "loss=smoothap",
    ]


def test_a_section_replaced_after_one_of_its_keys_is_refused(tmp_path: Path) -> None:
    """The sweep's loss.temperature under a variant's whole `loss:` section was dropped without a word."""
    spec = _spec(
        overrides={"train.steps": 2, "loss.temperature": 0.05},
        variants=[{"name": "smooth", "overrides": {"loss": {"name": "smoothap"}}}],
    )
    with pytest.raises(ConfigError) as refused:
        load_sweep(_write(tmp_path / "s.yaml", spec))
    assert str(refused.value) == (
        "sweep t: variant 'smooth' replaces the whole section loss, which drops loss.temperature=0.05 set "
        "before it; put temperature inside that section's value, or set the section's keys one by one "
        "(loss.<key>)"
    )
    both = _spec(overrides={"train.steps": 2, "loss.temperature": 0.05, "loss": {"name": "smoothap"}})
    with pytest.raises(ConfigError, match=r"^sweep t: overrides.loss replaces the whole section loss"):
        load_sweep(_write(tmp_path / "o.yaml", both))
    # a key set after its section is replaced applies to the new section
    fine = _spec(
        variants=[{"name": "s", "overrides": {"loss": {"name": "smoothap"}, "loss.temperature": 0.05}}]
    )
    assert load_sweep(_write(tmp_path / "f.yaml", fine)).trials[0].config.loss.temperature == 0.05
    # the command line's whole sections: the README promised the same refusal, but `data={root: ...}`
    # silently undid the sweep file's data.flip: false (and a whole loss= made every variant the same)
    keys = _write(tmp_path / "k.yaml", _spec(overrides={"train.steps": 2, "data.flip": False}))
    with pytest.raises(ConfigError) as refused:
        load_sweep(keys, ["data={root: elsewhere}"])
    assert str(refused.value) == (
        "sweep t: the command line's data=... replaces the whole section data, which drops data.flip=False "
        "set by the sweep file; set the section's keys one by one (data.<key>=...)"
    )
    assert load_sweep(keys, ["data.root=elsewhere"]).trials[0].config.data.flip is False
    sections = _write(
        tmp_path / "v.yaml", _spec(variants=[{"name": "s", "overrides": {"loss": {"name": "smoothap"}}}])
    )
    with pytest.raises(ConfigError, match=r"drops loss=\{'name': 'smoothap'\} set by the sweep file"):
        load_sweep(sections, ["loss={name: fastap}"])


def test_a_sweep_name_is_a_plain_folder_name(tmp_path: Path) -> None:
    """--name a/b nested Tune's experiment folder (run.name refuses the same)."""
    path = _write(tmp_path / "s.yaml", _spec())
    with pytest.raises(ConfigError, match=r"^--name 'a/b': must be a plain name"):
        load_sweep(path, name="a/b")
    with pytest.raises(ConfigError, match=r"name: must be a plain name"):
        load_sweep(_write(tmp_path / "n.yaml", {**_spec(), "name": "../up"}))
    assert load_sweep(path, name="other").spec.name == "other"


def test_the_sweeps_own_settings_are_not_overridden_silently(tmp_path: Path) -> None:
    """run.name and the file's experiment were replaced after the command line's overrides; trials that
    differ in the settings the sweep takes from its first trial were tracked or checked elsewhere."""
    path = _write(tmp_path / "s.yaml", _spec(experiment="from-file"))
    with pytest.raises(
        ConfigError, match=r"^sweep t, trial 'base': run.name=mine is replaced by the sweep's"
    ):
        load_sweep(path, ["run.name=mine"])
    with pytest.raises(
        ConfigError, match=r"mlflow.experiment=mine is replaced by the sweep file's experiment"
    ):
        load_sweep(path, ["mlflow.experiment=mine"])
    # what the sweep sets anyway, and sections replaced whole (the base's run.name goes with its section)
    whole = _spec(
        experiment="from-file", overrides={"train.steps": 2, "run": {"storage_path": str(tmp_path)}}
    )
    whole["overrides"]["mlflow"] = {"experiment": "from-file"}
    trial = load_sweep(_write(tmp_path / "w.yaml", whole), ["mlflow.experiment=from-file"]).trials[0]
    assert (trial.config.run.name, trial.config.mlflow.experiment) == ("t.base", "from-file")
    assert (
        load_sweep(_write(tmp_path / "e.yaml", _spec()), ["mlflow.experiment=mine"])
        .trials[0]
        .config.mlflow.experiment
        == "mine"
    )
    split = _spec(
        variants=[
            {"name": "a", "overrides": {"run.storage_path": str(tmp_path / "a")}},
            {"name": "b", "overrides": {"run.storage_path": str(tmp_path / "b")}},
        ]
    )
    with pytest.raises(ConfigError, match=r"^sweep t: every trial must share run.storage_path .*'a': "):
        load_sweep(_write(tmp_path / "v.yaml", split))


def test_a_baseline_stopped_by_ctrl_c_is_run_again_in_place(
    tmp_path: Path, glyphs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the pixel baseline left its child run FAILED; the relaunch made a second one, and the
    summary listed 'raw pixels' twice and lost its reference line (the FAILED run, newest, won)."""
    import dmltrain.service.sweeps.baselines as baselines
    from dmltrain.service.sweeps import driver
    from dmltrain.service.sweeps.summary import collect

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = {
        "mlflow.tracking_uri": uri,
        "run.storage_path": str(tmp_path / "ray"),
        "data.root": str(glyphs_root),
    }
    sweep = load_sweep(
        _write(
            tmp_path / "s.yaml",
            _spec(experiment="b", baselines=["pixels"], overrides={**overrides, "data.prepare": None}),
        )
    )
    trial, key = sweep.trials[0], f"{tmp_path / 'ray'}/t"
    parent, _ = driver._parent_run(sweep, list(sweep.trials), uri, key)
    real = baselines.pixel_baseline

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(baselines, "pixel_baseline", interrupted)
    with pytest.raises(KeyboardInterrupt):
        driver._baselines(sweep, trial, uri, parent, key)
    (stopped,) = collect(uri, parent)
    assert stopped.status == "KILLED"  # stopped, not failed
    monkeypatch.setattr(baselines, "pixel_baseline", real)
    driver._baselines(sweep, trial, uri, parent, key)
    (again,) = collect(uri, parent)
    assert (again.run_id, again.status, again.kind) == (stopped.run_id, "FINISHED", "baseline")
    assert again.final("recall_at_1") is not None
    # a store from before, with a failed run beside the finished one (newer): the finished one stands
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    finished = client.get_run(again.run_id)
    extra = client.create_run(finished.info.experiment_id, tags=finished.data.tags).info.run_id
    client.set_terminated(extra, "FAILED")
    assert [(r.run_id, r.status) for r in collect(uri, parent)] == [(again.run_id, "FINISHED")]


def test_a_relaunch_records_its_own_trials_and_overrides_on_the_parent(tmp_path: Path) -> None:
    """A relaunch of an edited sweep continued the parent run with the first launch's trial list, and the
    command line's overrides were recorded nowhere."""
    from mlflow.tracking import MlflowClient

    from dmltrain.service.sweeps import driver

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec(experiment="r", variants=[{"name": "a", "overrides": {}}])
    spec["overrides"]["mlflow.tracking_uri"] = uri
    path = _write(tmp_path / "s.yaml", spec)
    first = load_sweep(path)
    parent, resumed = driver._parent_run(first, list(first.trials), uri, "k")
    spec["variants"].append({"name": "b", "overrides": {"optim.lr": 0.002}})
    second = load_sweep(_write(path, spec), ["train.steps=3"])
    assert driver._parent_run(second, list(second.trials), uri, "k") == (parent, True) and not resumed
    client = MlflowClient(uri)
    folder = tmp_path / "artifacts"
    listing = yaml.safe_load(Path(client.download_artifacts(parent, "trials.yaml", str(folder))).read_text())
    assert [t["label"] for t in listing] == ["a", "b"]
    overrides = Path(client.download_artifacts(parent, "command_line_overrides.yaml", str(folder)))
    assert yaml.safe_load(overrides.read_text()) == ["train.steps=3"]
    assert client.get_run(parent).data.tags["dmltrain.sweep.trials"] == "2"


def test_a_bad_trial_is_refused_naming_trial_and_key(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "s.yaml", _spec(variants=[{"name": "typo", "overrides": {"optim.lr_rate": 0.1}}])
    )
    with pytest.raises(ConfigError, match=r"(?s)sweep t, trial 'typo'.*\n  optim.lr_rate: unknown key"):
        load_sweep(path)
    with pytest.raises(ConfigError, match=r"grid.train.steps has no values"):
        load_sweep(_write(tmp_path / "g.yaml", _spec(grid={"train.steps": []})))
    with pytest.raises(ConfigError, match=r"base config not found"):
        load_sweep(_write(tmp_path / "b.yaml", _spec(base="missing.yaml")))
    # Every problem of the file, one line each (only the first was named, then "(and 2 more)").
    with pytest.raises(ConfigError) as refused:
        load_sweep(_write(tmp_path / "n.yaml", {"trials": [{"name": "a"}]}))
    assert str(refused.value).splitlines()[1:] == [
        "  name: Field required",
        "  base: Field required",
        "  trials: Extra inputs are not permitted",
    ]


def test_concurrency_follows_the_cluster(tmp_path: Path) -> None:
    two_workers = {"train.steps": 2, "scaling.num_workers": 2, "scaling.cpus_per_worker": 1}
    spec = _spec(overrides=two_workers, grid={"optim.lr": [1e-3, 1e-4, 1e-5]})
    trials = list(load_sweep(_write(tmp_path / "s.yaml", spec)).trials)  # 2 workers x 1 CPU each
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 2}) == 1
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 5}) == 2
    assert concurrent_trials(trials, {"CPU": 1}, {"CPU": 6}) == 2
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64}) == 3  # never more than there are trials
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64, "GPU": 4}) == 2  # 2 GPU workers each
    # On one node, /dev/shm over the most a trial's loaders keep there (Tune does not see it).
    gib = 2**30
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64}, [gib, 3 * gib, gib], 7 * gib) == 2
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64}, [gib] * 3, 64 * gib) == 3
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64}, [2 * gib] * 3, gib) == 1  # refused earlier
    assert concurrent_trials(trials, {"CPU": 0}, {"CPU": 64}, [gib] * 3, None) == 3  # /dev/shm unknown


def test_a_trial_the_local_cluster_cannot_hold_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """Only the first trial's workers were counted against the machine before Ray started: a later one
    asking for more CPUs than it has failed inside Tune, after the baselines and earlier trials had run
    (120 s here), and a trial's own launch does not count the CPUs its Tune trial holds."""
    import ray

    started = ray.is_initialized()  # the session's in-process cluster, when an earlier test started it
    cpus = int(ray.cluster_resources()["CPU"]) if started else os.cpu_count() or 1
    where = {"train.steps": 2, "run.storage_path": str(tmp_path / "ray")}
    grid = {"scaling.num_workers": [1], "scaling.cpus_per_worker": [1, cpus + 1]}
    sweep = load_sweep(_write(tmp_path / "s.yaml", _spec(overrides=where, grid=grid)))
    with pytest.raises(
        ConfigError, match=rf"sweep t, trial '.*cpus_per_worker={cpus + 1}': scaling.num_workers="
    ):
        run_sweep(sweep)
    # The trial's driver counts too when the sweep gives it CPUs.
    one = {**where, "scaling.num_workers": 1, "scaling.cpus_per_worker": cpus}
    sweep = load_sweep(_write(tmp_path / "d.yaml", _spec(overrides=one, trial_resources={"CPU": 1})))
    with pytest.raises(ConfigError, match=r"\+ 1 for the trial's driver \(trial_resources\)"):
        run_sweep(sweep)
    assert ray.is_initialized() == started
    assert not (tmp_path / "ray").exists()


@pytest.mark.service
def test_two_trial_sweep_nests_child_runs_under_one_parent(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = _write(
        tmp_path / "sweep.yaml",
        {
            "name": "tiny",
            "base": str(REPO / "configs" / "quickstart.yaml"),
            "experiment": "sweep-test",
            "overrides": {
                "data.root": str(glyphs_root),
                "data.prepare": None,
                "train.steps": 2,
                "train.global_batch_size": 32,
                "train.chunk_size": 16,
                "train.log_every": 1,
                "train.eval_every": 2,
                "eval.max_images": 400,
                "eval.grid_queries": 0,
                "run.storage_path": str(tmp_path / "ray_results"),
                "mlflow.tracking_uri": tracking,
                "mlflow.log_checkpoints": False,  # 130 MB a trial this test does not look at
            },
            "variants": [
                {"name": "smoothap", "overrides": {"loss": {"name": "smoothap"}}},
                {"name": "fastap", "overrides": {"loss": {"name": "fastap", "num_bins": 10}}},
            ],
            "baselines": ["pixels"],
            "max_concurrent_trials": 1,
        },
    )
    outcome = run_sweep(load_sweep(path))
    assert outcome.failed == {}
    client = MlflowClient(tracking)
    parent = client.get_run(outcome.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["dmltrain.sweep"] == "tiny"
    artifacts = {a.path for a in client.list_artifacts(outcome.parent_run_id)}
    assert {"summary.md", "summary.json", "sweep.yaml", "trials.yaml", "plots"} <= artifacts
    listing = Path(client.download_artifacts(outcome.parent_run_id, "trials.yaml", str(tmp_path))).read_text()
    assert "&id" not in listing and "*id" not in listing, listing  # plain YAML a person reads, no aliases
    assert [t["label"] for t in yaml.safe_load(listing)] == ["smoothap", "fastap"]
    plots = {a.path for a in client.list_artifacts(outcome.parent_run_id, "plots")}
    assert {"plots/recall_at_1_by_step.png", "plots/recall_at_1_by_images.png"} <= plots

    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent.info.run_id}'"
    )
    by_label = {run.data.tags[TRIAL_TAG]: run for run in children}
    assert set(by_label) == {"smoothap", "fastap", "raw pixels"}
    assert BASELINE_TAG in by_label["raw pixels"].data.tags
    for label in ("smoothap", "fastap"):
        run = by_label[label]
        assert run.info.status == "FINISHED" and run.data.params["loss.name"] == label
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/test/recall_at_1"))
        assert steps == [0, 2]
        assert run.data.metrics["train/peak_rss_mb"] > 100
        assert run.data.metrics["train/step_seconds"] > 0
    # every trial starts from the same seeded network: one untrained figure
    step0 = {
        label: next(
            m.value
            for m in client.get_metric_history(by_label[label].info.run_id, "eval/test/recall_at_1")
            if m.step == 0
        )
        for label in ("smoothap", "fastap")
    }
    assert step0["smoothap"] == step0["fastap"]
    rows = {r.label: r.row() for r in outcome.results}
    assert rows["fastap"]["images_seen"] == 64 and rows["raw pixels"]["recall_at_1"] > 0
    assert "| untrained network (step 0) |" in outcome.summary

    # A relaunch continues the same parent; finished trials are not trained again (no new child runs).
    again = run_sweep(load_sweep(path))
    assert again.parent_run_id == outcome.parent_run_id and again.failed == {}
    rerun = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent.info.run_id}'"
    )
    assert len(rerun) == 3
    assert {r.label: r.row()["recall_at_1"] for r in again.results} == {
        r.label: r.row()["recall_at_1"] for r in outcome.results
    }


@pytest.mark.service
def test_a_stopped_sweep_says_it_stopped_and_how_to_continue(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    """Ctrl-C on `dmltrain sweep`: Tune stops the trials and returns; the driver then said "sweep finished",
    reported the unstarted trials as failed and printed Tune's `Tuner.restore` hint. It must say the sweep
    stopped, which trials did not finish, that the same command continues it, and exit 130."""
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = _write(
        tmp_path / "sweep.yaml",
        {
            "name": "stopped",
            "base": str(REPO / "configs" / "quickstart.yaml"),
            "experiment": "sweep-stop-test",
            "overrides": {
                "data.root": str(glyphs_root),
                "data.prepare": None,
                "train.steps": 2000,
                "train.global_batch_size": 32,
                "train.chunk_size": 32,
                "train.log_every": 1,
                "train.eval_at_start": False,
                "run.storage_path": str(tmp_path / "ray_results"),
                "mlflow.tracking_uri": tracking,
                "mlflow.log_checkpoints": False,
                "scaling.topology": "single-node",  # joins this session's cluster (RAY_ADDRESS)
            },
            "variants": [{"name": "a", "overrides": {}}, {"name": "b", "overrides": {}}],
            "max_concurrent_trials": 1,
        },
    )
    driver = subprocess.Popen(
        [str(Path(sys.executable).parent / "dmltrain"), "sweep", str(path)],
        cwd=tmp_path,
        env={**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = MlflowClient(tracking)

    def training() -> bool:
        if driver.poll() is not None:
            raise AssertionError(f"sweep exited early:\n{driver.stdout.read()[-4000:]}")
        experiment = (
            client.get_experiment_by_name("sweep-stop-test") if (tmp_path / "mlflow.db").exists() else None
        )
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        return any(TRIAL_TAG in r.data.tags and "train/loss" in r.data.metrics for r in runs)

    try:
        deadline = time.monotonic() + 300
        while not training():
            assert time.monotonic() < deadline, "no trial trained within 300 s"
            time.sleep(1)
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, output[-4000:]
    assert "sweep stopped: 2 trial(s) did not finish: 'a' (KILLED), 'b' (not started)" in output, output[
        -4000:
    ]
    assert "The same command continues it" in output
    assert "Tuner.restore" not in output and "sweep finished" not in output and "error: trial" not in output
    experiment_id = client.get_experiment_by_name("sweep-stop-test").experiment_id
    runs = {r.data.tags.get(TRIAL_TAG, "parent"): r for r in client.search_runs([experiment_id])}
    assert runs["parent"].info.status == "KILLED" and runs["a"].info.status == "KILLED"


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_sweeps_load_and_pin_the_layout_they_were_measured_on(path: Path) -> None:
    """Every trial of every shipped study validates, and every study names its own layout (Ray workers,
    threads, CPUs, loader processes), so its README table does not drift when the quickstart's changes."""
    sweep = load_sweep(path)
    trials = list(sweep.trials)
    assert trials, path
    spec = yaml.safe_load(path.read_text())
    overrides = spec["overrides"]
    assert "data.loader_workers" in overrides, path
    if "scaling" in overrides:
        layouts = [overrides["scaling"]] * len(trials)
    else:  # a study of layouts pins one in each variant
        layouts = [variant["overrides"]["scaling"] for variant in spec["variants"]]
    for pinned, trial in zip(layouts, trials, strict=True):
        assert set(pinned) >= {"num_workers", "torch_threads", "cpus_per_worker"}, trial.label
        scaling = trial.config.scaling
        assert (scaling.num_workers, scaling.torch_threads, scaling.cpus_per_worker) == (
            pinned["num_workers"],
            pinned["torch_threads"],
            pinned["cpus_per_worker"],
        ), trial.label
        assert trial.config.data.loader_workers == overrides["data.loader_workers"], trial.label
