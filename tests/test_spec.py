"""Tests for orchestrator/spec.py: good specs load, bad ones say FILE:LINE: FIELD and how to fix."""

import dataclasses
import re
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.spec import (AcceleratorRequest, JobSpec, SpecError, load_spec,
                               parse_duration)
from providers.identity import KINDS

FULL = """\
name: tiny-gpt
num_nodes: 2
nproc_per_node: auto
workdir: src
setup: |
  pip install -r requirements.txt
run: python train.py
envs:
  SEED: 1
  DEBUG: true
  LR: 0.5
  MODE: fast
steps: 300
resources:
  accelerators: H100:8
  cpus: 4+
  memory: 16+
  use_spot: true
  infra: [aws, gcp]
  regions: us-east-1
  max_hourly_cost: 30.0
checkpoint:
  dir: ckpt
  interval: 10m
  keep: 5
recovery:
  max_restarts: 4
  spares: 1
health:
  heartbeat_timeout: 1m30s
"""


def write(tmp_path, text, name="train.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def errors(path, overrides=None, check=None):
    """The messages of the SpecError that loading `path` must raise; each checked to be one line."""
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides, check)
    msgs = info.value.messages
    assert msgs and str(info.value) == "\n".join(msgs)
    for m in msgs:
        assert len(m.splitlines()) == 1, m
        assert m.startswith(f"{path}:"), m
    return msgs


def one(path, line, field, *needles):
    """Exactly the message for `field` at `line`, containing each needle."""
    prefix = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    found = [m for m in errors(path) if m.startswith(prefix)]
    assert len(found) == 1, (prefix, errors(path))
    for needle in needles:
        assert needle in found[0], (needle, found[0])
    return found[0]


# --- good files --------------------------------------------------------------------------------

def test_full_example(tmp_path):
    spec = load_spec(write(tmp_path, FULL))
    assert spec.name == "tiny-gpt" and spec.num_nodes == 2 and spec.steps == 300
    assert spec.workdir == str(tmp_path / "src")
    assert spec.setup == "pip install -r requirements.txt\n"
    assert spec.run == "python train.py"
    assert spec.envs == {"SEED": "1", "DEBUG": "true", "LR": "0.5", "MODE": "fast"}
    r = spec.resources
    assert r.accelerator_choices() == [AcceleratorRequest(name="H100", count=8)]
    assert not r.accelerators_any_of
    assert (r.cpus.count, r.cpus.at_least, str(r.cpus)) == (4, True, "4+")
    assert (r.memory.count, r.memory.at_least) == (16, True)
    assert r.use_spot and r.infra == ["aws", "gcp"] and r.regions == ["us-east-1"]
    assert r.max_hourly_cost == 30.0
    assert spec.checkpoint.dir == str(tmp_path / "src" / "ckpt")
    assert spec.checkpoint.interval_seconds == 600 and spec.checkpoint.interval_steps is None
    assert not spec.checkpoint.is_auto and spec.checkpoint.keep == 5
    assert (spec.recovery.max_restarts, spec.recovery.spares) == (4, 1)
    assert spec.health.heartbeat_timeout == 90.0
    assert spec.nprocs() == 8


def test_minimal(tmp_path):
    spec = load_spec(write(tmp_path, "run: python train.py\n", name="my-job.yaml"))
    assert spec.name == "my-job"                       # the file's stem
    assert spec.workdir == str(tmp_path)
    assert (spec.num_nodes, spec.nproc_per_node, spec.nprocs()) == (1, "auto", 1)
    assert spec.envs == {} and spec.steps is None and spec.setup is None
    assert spec.resources.accelerator_choices() == [] and not spec.resources.use_spot
    assert spec.checkpoint.is_auto and spec.checkpoint.dir is None and spec.checkpoint.keep == 3
    assert spec.checkpoint.interval_steps is None and spec.checkpoint.interval_seconds is None
    assert (spec.recovery.max_restarts, spec.recovery.spares) == (3, 0)
    assert spec.health.heartbeat_timeout == 30.0


def test_stem_that_is_not_a_valid_name(tmp_path):
    assert load_spec(write(tmp_path, "run: x\n", name="_my job!.yaml")).name == "my-job-"


def test_a_name_of_digits_only_is_refused_as_the_cli_reads_it_as_a_job_id(tmp_path):
    """`tfsn stop 2` stops job id 2: a job named "2" could not be reached by its name, and another job was stopped."""
    one(write(tmp_path, "run: x\nname: '2'\n"), 2, "name", "digits only", "job id", "'job-2'")
    assert load_spec(write(tmp_path, "run: x\n", name="2.yaml")).name == "job-2"      # the stem as a default
    assert load_spec(write(tmp_path, "run: x\nname: 2nd-try\n")).name == "2nd-try"


def test_accelerator_list_is_ordered_preference(tmp_path):
    spec = load_spec(write(tmp_path, "run: x\nresources:\n  accelerators: [H100:8, a100]\n"))
    assert spec.resources.accelerators == ["H100:8", "a100:1"]
    assert not spec.resources.accelerators_any_of
    choices = spec.resources.accelerator_choices()
    assert [(c.name, c.count) for c in choices] == [("H100", 8), ("a100", 1)]
    assert choices[1].matches("A100")
    assert spec.nprocs() == 8 and spec.nprocs(choices[1].count) == 1


def test_accelerator_mapping_is_any_of(tmp_path):
    spec = load_spec(write(tmp_path, "run: x\nresources:\n  accelerators: {H100: 8, L4: 2, T4}\n"))
    assert spec.resources.accelerators_any_of
    assert [(c.name, c.count) for c in spec.resources.accelerator_choices()] == [
        ("H100", 8), ("L4", 2), ("T4", 1)]


def test_explicit_nproc_and_steps_interval(tmp_path):
    spec = load_spec(write(tmp_path, """\
        run: x
        nproc_per_node: 3
        resources: {accelerators: H100:8}
        checkpoint: {interval: 500}
        """))
    assert spec.nprocs() == 3
    assert spec.checkpoint.interval_steps == 500 and spec.checkpoint.interval_seconds is None


def test_counts_written_as_text_are_the_numbers_they_name(tmp_path):
    """SkyPilot and dstack users quote counts: `num_nodes: "2"` was refused, and `{A100: "8"}` or `nproc_per_node: "8"`
    with "'8' is not a whole number" / "not a process count", which reads as nonsense."""
    spec = load_spec(write(tmp_path, """\
        run: x
        num_nodes: "2"
        nproc_per_node: "8"
        steps: " 300 "
        resources: {accelerators: {A100: "8", H100: '4'}}
        checkpoint: {keep: "5"}
        recovery: {max_restarts: "4", spares: "1"}
        model: {params: 1B, layers: "2", hidden: "64", seq_len: "32", batch_size: "8"}
        """))
    assert (spec.num_nodes, spec.nproc_per_node, spec.steps, spec.checkpoint.keep) == (2, 8, 300, 5)
    assert (spec.recovery.max_restarts, spec.recovery.spares, spec.model.layers, spec.model.batch_size) == (4, 1, 2, 8)
    assert spec.resources.accelerators == {"A100": 8, "H100": 4}
    one(write(tmp_path, "run: x\nnum_nodes: '2.5'\n"), 2, "num_nodes", "valid integer", "'2.5'")
    spec = load_spec(write(tmp_path, "run: x\nsteps: 1e6\nnum_nodes: 2.0\nresources: {accelerators: {A100: 8.0}}\n"))
    assert (spec.steps, spec.num_nodes, spec.resources.accelerators) == (1_000_000, 2, {"A100": 8})   # ML's 1e6
    one(write(tmp_path, "run: x\nsteps: 2.5\n"), 2, "steps", "valid integer", "2.5")
    one(write(tmp_path, "run: x\nsteps: 1e30\n"), 2, "steps", "at most 1000000000")
    one(write(tmp_path, "run: x\nnum_nodes: '0'\n"), 2, "num_nodes", "greater than or equal to 1")


@pytest.mark.parametrize("written", ['"$40"', '"40"', '"40 USD"', '"$40/hr"', "40", "40.0"])
def test_an_hourly_cost_written_as_a_price_is_its_dollars(tmp_path, written):
    """`max_hourly_cost: "$40"` (and "40", "$40/hr") was refused as "input should be a valid number"."""
    assert load_spec(write(tmp_path, f"run: x\nresources:\n  max_hourly_cost: {written}\n")).resources.max_hourly_cost == 40


def test_an_hourly_cost_in_another_currency_or_not_a_price_is_refused(tmp_path):
    one(write(tmp_path, "run: x\nresources:\n  max_hourly_cost: '€40'\n"), 3, "resources.max_hourly_cost", "'€40'",
        "max_hourly_cost: 30.0")
    one(write(tmp_path, "run: x\nresources:\n  max_hourly_cost: '$0'\n"), 3, "resources.max_hourly_cost",
        "greater than 0")


@pytest.mark.parametrize("written, gib, at_least", [
    ("32GB", 32, False), ("32 GiB", 32, False), ("32gb+", 32, True), ("1TB+", 1024, True), ("512MB", 0.5, False),
    ("64G", 64, False), ("16+", 16, True),
])
def test_memory_with_a_unit(tmp_path, written, gib, at_least):
    """`memory: 32GB` (dstack's form, SkyPilot's too) was refused as "not a positive amount"; it is 32 GiB."""
    memory = load_spec(write(tmp_path, f"run: x\nresources:\n  memory: {written}\n")).resources.memory
    assert (memory.count, memory.at_least) == (gib, at_least)


def test_memory_with_an_unknown_unit_and_cpus_with_a_unit_are_refused(tmp_path):
    one(write(tmp_path, "run: x\nresources:\n  memory: 32KB\n"), 3, "resources.memory", "'32KB'", "'32GB+'")
    one(write(tmp_path, "run: x\nresources:\n  cpus: 4GB\n"), 3, "resources.cpus", "'4GB'", "'4+'")


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("1h 30m", 5400), ("2d", 172800),
    ("250ms", 0.25), ("45", 45), ("1.5m", 90), (12, 12), (0.5, 0.5), ("  10M ", 600),
    # units spelled out, as people write them (were "invalid duration")
    ("30sec", 30), ("5 min", 300), ("10 mins", 600), ("2hours", 7200), ("1 hour 30 minutes", 5400), ("2 hrs", 7200),
    ("1 day", 86400), ("30msec", 0.03), ("45 seconds", 45),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10 parsecs", "-5s", "s", "1h-30m", "5mi", "3hx", "10 secondsx", True, None, -1,
                                  float("nan"), float("inf"), "9" * 400 + "s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="To fix"):
        parse_duration(text)


@pytest.mark.parametrize("value,seconds", [("10s", 10), (5, 5), (2.5, 2.5), ("1h", 3600)])
def test_heartbeat_durations(tmp_path, value, seconds):
    path = write(tmp_path, f"run: x\nhealth:\n  heartbeat_timeout: {value}\n")
    assert load_spec(path).health.heartbeat_timeout == seconds


def test_paths_resolve_against_file_and_workdir(tmp_path):
    (tmp_path / "jobs").mkdir()
    path = write(tmp_path, "run: x\nworkdir: ../code\ncheckpoint:\n  dir: out/ckpt\n",
                 name="jobs/train.yaml")
    spec = load_spec(path)
    assert spec.workdir == str(tmp_path / "code")
    assert spec.checkpoint.dir == str(tmp_path / "code" / "out" / "ckpt")
    abs_dir = str(tmp_path / "elsewhere")
    spec = load_spec(write(tmp_path, f"run: x\nworkdir: {abs_dir}\ncheckpoint: {{dir: /ck}}\n"))
    assert spec.workdir == abs_dir and spec.checkpoint.dir == "/ck"


def test_paths_fill_in_variables_from_envs_then_the_shell(tmp_path, monkeypatch):
    """`workdir: $HOME/code` was a folder literally named '$HOME' beside train.yaml, and `dir: $SCRATCH/ckpt` put the
    checkpoints there; SkyPilot users write `s3://${BUCKET}/run` with BUCKET in envs (or --env)."""
    monkeypatch.setenv("TFSN_TEST_SCRATCH", str(tmp_path / "scratch"))
    spec = load_spec(write(tmp_path, "run: x\nworkdir: $TFSN_TEST_SCRATCH/code\ncheckpoint:\n  dir: ${RUN}/ckpt\n"
                                     "envs: {RUN: r1}\n"))
    assert spec.workdir == str(tmp_path / "scratch" / "code")
    assert spec.checkpoint.dir == str(tmp_path / "scratch" / "code" / "r1" / "ckpt")
    path = write(tmp_path, "run: x\ncheckpoint: {dir: 's3://${BUCKET}/run1'}\nenvs: {BUCKET: lab}\n")
    assert load_spec(path).checkpoint.dir == "s3://lab/run1"
    assert load_spec(path, overrides={"BUCKET": "other"}).checkpoint.dir == "s3://other/run1"   # --env wins
    monkeypatch.delenv("TFSN_TEST_UNSET", raising=False)
    one(write(tmp_path, "run: x\ncheckpoint:\n  dir: $TFSN_TEST_UNSET/ckpt\n"), 3, "checkpoint.dir",
        "$TFSN_TEST_UNSET", "add it to envs")
    one(write(tmp_path, "run: x\nworkdir: '${TFSN_TEST_UNSET}'\n"), 2, "workdir", "--env TFSN_TEST_UNSET=")


@pytest.mark.parametrize("written, form", [("'${RUN:-r1}/ckpt'", "${RUN:-r1}"), ("/ckpt/$(RUN)", "$(RUN)"),
                                           ("'/ckpt/${}'", "${}"), ("'/ckpt/${RUN'", "${RUN")])
def test_a_variable_in_a_form_tfsn_does_not_fill_is_refused_not_made_a_folder(tmp_path, written, form):
    """`dir: ${RUN:-r1}/ckpt` (a shell default) and `dir: /ckpt/$(RUN)` (a pod's command, for a TfsnJob) were taken as
    written: folders literally named '${RUN:-r1}' and '$(RUN)', as '$HOME' was before $NAME was filled in."""
    path = write(tmp_path, f"run: x\nenvs: {{RUN: r1}}\ncheckpoint:\n  dir: {written}\n")
    one(path, 4, "checkpoint.dir", f"{form!r}", "fills $NAME and ${NAME}", "To fix")
    assert JobSpec.model_validate({"name": "a", "run": "x", "envs": {"RUN": "r1"}, "checkpoint": {"dir": "/d/$$/$"}},
                                  context={"shell": False}).checkpoint.dir == "/d/$$/$"   # a lone $ is a $


def test_a_filled_in_checkpoint_dir_gets_the_checks_a_written_one_does(tmp_path, monkeypatch):
    """checkpoint.dir's own checks ran on the text before $NAME was filled in: `dir: $CKPT` with CKPT set but empty
    put the checkpoints in the workdir among the code (refused when written out: ''), and CKPT='gs:/bucket' made a
    folder 'gs:' there (refused when written out as a mistyped gs://bucket)."""
    monkeypatch.setenv("TFSN_TEST_EMPTY", "")
    one(write(tmp_path, "run: x\ncheckpoint:\n  dir: $TFSN_TEST_EMPTY\n"), 3, "checkpoint.dir", "empty")
    monkeypatch.setenv("TFSN_TEST_URL", "gs:/bucket")
    one(write(tmp_path, "run: x\ncheckpoint:\n  dir: $TFSN_TEST_URL\n"), 3, "checkpoint.dir", "gs://bucket")


def test_a_filled_in_path_that_could_not_load_again_is_refused_at_load(tmp_path, monkeypatch):
    """A path's line-break check ran before $NAME was filled in: an env value holding a line break made a workdir
    that load_spec took and that the stored spec, validated again by the controller, refused."""
    path = write(tmp_path, "run: x\nworkdir: $SUB\nenvs:\n  SUB: \"a\\nb\"\n")
    try:
        spec = load_spec(path)
    except SpecError as err:
        assert "workdir" in str(err) and len(err.messages) == 1, err.messages
    else:
        JobSpec.model_validate(spec.model_dump(mode="json"))      # what the controller does with the stored spec


def test_env_overrides(tmp_path):
    path = write(tmp_path, "run: x\nenvs:\n  SEED: 1\n  TOKEN:\n")
    msgs = errors(path)                                 # TOKEN: null must come from --env
    assert len(msgs) == 1 and msgs[0].startswith(f"{path}:4: envs.TOKEN: ") and "--env" in msgs[0]
    spec = load_spec(path, {"SEED": "7", "TOKEN": "abc", "NEW": "x=y"})
    assert spec.envs == {"SEED": "7", "TOKEN": "abc", "NEW": "x=y"}
    assert load_spec(write(tmp_path, "run: x\n"), {"A": "1"}).envs == {"A": "1"}
    msgs = errors(path, {"BAD-NAME": "1"})
    assert msgs == [f"{path}:1: --env 'BAD-NAME': not a valid environment variable name. "
                    "To fix: use letters, digits and '_', not starting with a digit"]


def test_a_bad_value_given_with_env_is_blamed_on_the_command_line_not_the_file(tmp_path):
    """`--env B=<9000 characters>` said "train.yaml:1: envs.B: ...": a field the file does not have, on its line 1."""
    path = write(tmp_path, "run: x\nenvs:\n  A: 1\n")
    assert errors(path, {"A": "a\x1bb", "B": "x" * 9000}) == [
        f"{path}:1: --env A: a control character (U+001B) at character 2 is not allowed here. To fix: remove it",
        f"{path}:1: --env B: string should have at most 8192 characters, got 'xxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxx'. "
        "To fix: shorten it to at most 8192 characters"]


def test_env_values_reach_the_workers_as_written(tmp_path):
    """YAML reads unquoted `1.10` as 1.1, `010` as 8, `12:30` as 750 and `yes` as true: a worker got
    CUDA_VERSION=1.1 or a job id of 8. Unquoted numbers, bools and dates keep their text, merged ones too."""
    spec = load_spec(write(tmp_path, """\
        run: x
        envs:
          <<: {BASE_LR: 3.0e-4, VERSION: 2.0}
          VERSION: 1.10
          JOB: 010
          MASK: 0x1F
          AT: 12:30
          DEBUG: yes
          FLAG: True
          DAY: 2024-01-01
          QUOTED: "1.10"
          SEED: 1337
        """))
    assert spec.envs == {"BASE_LR": "3.0e-4", "VERSION": "1.10", "JOB": "010", "MASK": "0x1F", "AT": "12:30",
                         "DEBUG": "yes", "FLAG": "True", "DAY": "2024-01-01", "QUOTED": "1.10", "SEED": "1337"}


def test_envs_as_a_list_of_name_value_pairs(tmp_path):
    """dstack's (and docker compose's) form, `[NAME=VALUE, ...]`, was refused as "not a mapping"; it is the mapping it
    means, `--env` still overrides it, and an item without a value or a name given twice is refused."""
    path = write(tmp_path, "run: x\nenvs:\n  - VERSION=1.10\n  - URL=a=b\n  - EMPTY=\n")
    assert load_spec(path).envs == {"VERSION": "1.10", "URL": "a=b", "EMPTY": ""}
    assert load_spec(path, {"VERSION": "2"}).envs == {"VERSION": "2", "URL": "a=b", "EMPTY": ""}
    one(write(tmp_path, "run: x\nenvs: [A=1, TOKEN]\n"), 2, "envs", "'TOKEN' is not NAME=VALUE", "--env NAME=VALUE")
    one(write(tmp_path, "run: x\nenvs: [A=1, A=2]\n"), 2, "envs", "'A' is given twice")
    one(write(tmp_path, "run: x\nenvs: [A=1, 1X=2]\n"), 2, "envs", "'1X' is not a valid environment variable name")


def test_envs_that_tfsn_sets_itself_are_refused_with_the_field_to_use(tmp_path):
    """`envs: {TFSN_CHECKPOINT_DIR: /data/ckpt}` was accepted and ignored (the workers saved where tfsn said);
    TFSN_JOB_ID or TFSN_CONTROLLER_URL there replaced the agent's own and cut the workers off their controller."""
    path = write(tmp_path, "run: x\nenvs:\n  SEED: 1\n  TFSN_CHECKPOINT_DIR: /data/ckpt\n  TFSN_JOB_ID: 3\n")
    assert errors(path) == [
        f"{path}:4: envs.TFSN_CHECKPOINT_DIR: tfsn sets TFSN_CHECKPOINT_DIR for every worker itself. To fix: set "
        "checkpoint.dir instead",
        f"{path}:5: envs.TFSN_JOB_ID: tfsn sets TFSN_JOB_ID for every worker itself. To fix: remove it"]
    path = write(tmp_path, "run: x\nenvs: {TFSN_STEPS: 5, TFSN_CACHE: /c}\n")     # read by the SDK: the user's to set
    assert errors(path, {"TFSN_CONTROLLER_URL": "http://x"}) == [
        f"{path}:1: --env TFSN_CONTROLLER_URL: tfsn sets TFSN_CONTROLLER_URL for every worker itself. To fix: remove it"]
    assert load_spec(path).envs == {"TFSN_STEPS": "5", "TFSN_CACHE": "/c"}


def test_json_round_trip(tmp_path):
    for text in (FULL, "run: x\n", "run: x\nresources:\n  accelerators: {H100: 8, A100: 8}\n",
                 "run: x\nresources: {accelerators: [H100:8, L4]}\ncheckpoint: {interval: 50}\n"):
        spec = load_spec(write(tmp_path, text))
        dumped = spec.model_dump(mode="json")
        again = JobSpec.model_validate(dumped)
        assert again == spec
        assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
        assert again.resources.accelerator_choices() == spec.resources.accelerator_choices()


def test_merge_keys_and_anchors(tmp_path):
    spec = load_spec(write(tmp_path, """\
        run: x
        recovery: &r {max_restarts: 1, spares: 2}
        health:
          heartbeat_timeout: 10s
        checkpoint:
          keep: 4
        """))
    assert spec.recovery.spares == 2
    path = write(tmp_path, "run: x\nrecovery: &r\n  spares: 2\nhealth:\n  <<: *r\n")
    one(path, 3, "health.spares", "unknown field 'spares'", "heartbeat_timeout")


# --- bad files ---------------------------------------------------------------------------------

def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "run: x\nnum_node: 2\n")
    one(path, 2, "num_node", "unknown field 'num_node'; did you mean 'num_nodes'?")


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  use_spot: true\n  acelerators: H100:8\n")
    one(path, 4, "resources.acelerators",
        "unknown field 'acelerators'; did you mean 'accelerators'?")


def test_unknown_key_without_close_match_lists_fields(tmp_path):
    path = write(tmp_path, "run: x\ncheckpoint:\n  zzzzz: 1\n")
    one(path, 3, "checkpoint.zzzzz", "unknown field 'zzzzz'", "dir, interval, keep")


@pytest.mark.parametrize("section, written, needle", [
    ("resources", "gpus: H100:8", "write it as 'accelerators', e.g. 'accelerators: H100:8'"),
    ("resources", "any_of: [{accelerators: H100:8}, {accelerators: A100:8}]", "'accelerators: {H100: 8, A100: 8}'"),
    ("resources", "ordered: [{accelerators: H100:8}]", "'accelerators: [H100:8, A100:8]'"),
    ("resources", "accelerator_args: {tpu_vm: true}", "To fix: remove it"),
    ("resources", "disk_size: 256", "To fix: remove it"),
    ("resources", "cloud: aws", "'infra: [aws]'"),
    (None, "commands: [python train.py]", "'run: |'"),
    (None, "file_mounts: {/data: s3://bucket}", "To fix: remove it"),
    (None, "image: pytorch/pytorch", "under 'kubernetes:'"),
])
def test_a_field_of_skypilot_or_dstack_says_what_tfsn_calls_it(tmp_path, section, written, needle):
    """`resources.gpus` (dstack, Kubernetes) got "did you mean 'cpus'?", `accelerator_args` "did you mean
    'accelerators'?", and SkyPilot's any_of, disk_size or file_mounts the list of tfsn's fields."""
    text = f"run: x\n{section}:\n  {written}\n" if section else f"run: x\n{written}\n"
    key = written.split(":")[0]
    message = one(write(tmp_path, text), 3 if section else 2, f"{section}.{key}" if section else key,
                  f"unknown field {key!r}. ", needle)
    assert "did you mean" not in message


def test_run_and_setup_as_lists_of_commands_say_how_to_write_one_script(tmp_path):
    """`run: [a, b]` (dstack's commands) said "input should be a valid string ... write it like 'run: python train.py'",
    as if one command were meant."""
    path = write(tmp_path, "run: [python prep.py, python train.py]\nsetup:\n  - pip install x\n")
    one(path, 1, "run", "a list of commands", "'run: |'", "set -e")
    one(path, 2, "setup", "a list of commands", "'setup: |'")


@pytest.mark.parametrize("written, url", [("gs:/lab/run1", "gs://lab/run1"), ("s3:lab", "s3://lab"),
                                          ("AZ:/box/ckpt", "az://box/ckpt")])
def test_a_bucket_url_with_a_slash_missing_is_refused_not_taken_as_a_folder(tmp_path, written, url):
    """`checkpoint.dir: gs:/lab/run1` was a folder "gs:" in workdir: the job checkpointed to the controller's disk, not
    the bucket (and on a local-only job said nothing)."""
    one(write(tmp_path, f"run: x\ncheckpoint:\n  dir: {written}\n"), 3, "checkpoint.dir",
        f"looks like a mistyped {url}. To fix: write {url}")
    assert load_spec(write(tmp_path, f"run: x\ncheckpoint:\n  dir: ./{written}\n")).checkpoint.dir == \
        str(tmp_path / written)


def test_an_empty_checkpoint_dir_is_refused_not_taken_as_the_workdir(tmp_path):
    """`checkpoint.dir: ""` was the workdir itself: checkpoints among the code (packed with it for cloud nodes)."""
    one(write(tmp_path, "run: x\ncheckpoint:\n  dir: ''\n"), 3, "checkpoint.dir", "empty", "remove it")


def test_health_thresholds_take_durations_with_a_unit_and_say_how_to_fix_a_bad_one(tmp_path):
    """README: a slow first step "needs health.thresholds.phase_timeout_max_s raised"; `phase_timeout_max_s: 2h`, as
    every other duration of the spec is written, was "input should be a valid number", with no fix."""
    spec = load_spec(write(tmp_path, "run: x\nhealth:\n  thresholds: {phase_timeout_max_s: 2h, hang_min_s: 90}\n"))
    assert spec.health.thresholds == {"phase_timeout_max_s": 7200.0, "hang_min_s": 90.0}
    one(write(tmp_path, "run: x\nhealth:\n  thresholds: {straggler_min_slowdown: 5%}\n"), 3,
        "health.thresholds.straggler_min_slowdown", "'5%'", "To fix: write a number")


@pytest.mark.parametrize("threshold, value, what", [
    ("straggler_window", "5 min", "counts steps"), ("cooldown_steps", "1h", "counts steps"),
    ("throttle_samples", "30s", "counts samples"), ("hang_step_factor", "10m", "is a factor"),
])
def test_a_duration_where_a_threshold_is_not_seconds_is_refused_saying_what_it_counts(tmp_path, threshold, value,
                                                                                      what):
    """`straggler_window: 5 min` was read as a window of 300 steps: a duration is seconds, for the *_s ones only."""
    path = write(tmp_path, f"run: x\nhealth:\n  thresholds:\n    {threshold}: {value}\n")
    one(path, 4, f"health.thresholds.{threshold}", f"{value!r} is a duration, but {threshold} {what}",
        "To fix: write a number")


@pytest.mark.parametrize("threshold, value, what", [("hang_min_s", "yes", "is in seconds"),
                                                    ("straggler_window", "true", "counts steps")])
def test_a_yes_or_no_threshold_is_refused_not_taken_as_1(tmp_path, threshold, value, what):
    """`hang_min_s: yes` was a hang called after 1 second: the number check refuses a bool, but it saw 1.0."""
    path = write(tmp_path, f"run: x\nhealth:\n  thresholds:\n    {threshold}: {value}\n")
    one(path, 4, f"health.thresholds.{threshold}", f"True is yes/no, but {threshold} {what}", "To fix: write a number")


def test_every_threshold_says_what_it_counts():
    from health.config import MEASURES, HealthConfig

    assert set(MEASURES) == {f.name for f in dataclasses.fields(HealthConfig)} - {"actions"}


@pytest.mark.parametrize("written, infra, regions", [
    ("infra: aws/us-east-1", ["aws"], ["us-east-1"]),
    ("{infra: [aws/us-east-1, gcp/us-central1], regions: [us-west-2]}", ["aws", "gcp"],
     ["us-west-2", "us-east-1", "us-central1"]),
    ("infra: aws/*", ["aws"], None),
    ("infra: k8s", ["kubernetes"], None),
    ("infra: 'gcp, aws'", ["gcp", "aws"], None),
])
def test_skypilot_infra_with_a_region_and_k8s_are_taken(tmp_path, written, infra, regions):
    """SkyPilot's `infra: aws/us-east-1` and `infra: k8s`, and "gcp, aws" as TFSN_CLOUDS is written, were "unknown
    provider"."""
    text = f"run: x\nresources: {written}\n" if written.startswith("{") else f"run: x\nresources:\n  {written}\n"
    resources = load_spec(write(tmp_path, text)).resources
    assert (resources.infra, resources.regions) == (infra, regions)


def test_skypilot_infra_with_a_zone_is_refused_saying_tfsn_picks_it(tmp_path):
    one(write(tmp_path, "run: x\nresources:\n  infra: aws/us-east-1/us-east-1a\n"), 2, "resources",
        "names a zone; tfsn picks the zone within the region. To fix: write aws/us-east-1")


def test_wrong_type(tmp_path):
    path = write(tmp_path, "run: x\nsteps: many\n")
    one(path, 2, "steps", "valid integer", "'many'", "To fix: write it like 'steps: 300'")
    path = write(tmp_path, "run: x\nresources: 5\n")
    one(path, 2, "resources", "expected a mapping", "accelerators")


def test_negative_num_nodes(tmp_path):
    path = write(tmp_path, "# my job\nrun: x\nnum_nodes: -1\n")
    one(path, 3, "num_nodes", "greater than or equal to 1", "-1")


def test_bad_accelerator(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  accelerators: H100:zero\n")
    one(path, 3, "resources.accelerators", "'zero'", "whole number", "To fix")
    path = write(tmp_path, "run: x\nresources:\n  accelerators: H100:0.5\n")
    one(path, 3, "resources.accelerators", "fractional")


def test_bad_duration(tmp_path):
    path = write(tmp_path, "run: x\nhealth:\n\n  heartbeat_timeout: soon\n")
    one(path, 4, "health.heartbeat_timeout", "invalid duration 'soon'", "'30s'")
    path = write(tmp_path, "run: x\ncheckpoint:\n  interval: 0s\n")
    one(path, 3, "checkpoint.interval", "longer than zero")


def test_bad_provider(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  infra: [aws, gpc]\n")
    one(path, 3, "resources.infra", "unknown provider 'gpc'; did you mean 'gcp'?", "kubernetes")


@pytest.mark.parametrize("item", ["{aws: us-east-1}", "[aws]"])
def test_a_provider_written_as_a_mapping_or_a_list_is_refused_naming_it(tmp_path, item):
    """`infra: [{aws: us-east-1}]` was a TypeError ('unhashable type'): 'cannot validate the spec' at line 1, and a
    TfsnJob's create handler failing for ever (infra is open in the CRD)."""
    path = write(tmp_path, f"run: x\nresources:\n  infra: [{item}]\n")
    one(path, 3, "resources.infra", "unknown provider", "To fix: use one of local, aws")


def test_missing_run(tmp_path):
    path = write(tmp_path, "name: job\nnum_nodes: 2\n")
    one(path, 1, "run", "required field is missing", "run: python train.py")


def test_missing_nested_field(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  cpus: {at_least: true}\n")
    one(path, 3, "resources.cpus.count", "required field is missing")


def test_yaml_syntax_error(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  accelerators: [H100:8\nsteps: 3\n")
    msgs = errors(path)
    assert len(msgs) == 1 and re.match(rf"{re.escape(str(path))}:\d+: invalid YAML: ", msgs[0])
    path = write(tmp_path, "run: x\nresources:\n  cpus: 2\n\taccelerators: H100:8\n")    # an editor's tab
    assert errors(path) == [f"{path}:4: invalid YAML: a tab at column 1: YAML indents and separates with spaces "
                            "only. To fix: replace the tabs with spaces"]


@pytest.mark.parametrize("text, line, fix", [
    ("run: x\nresources:\n  cpus: 2\n memory: 4\n", 4, "indent the fields of one mapping by the same spaces"),
    ("run: x\nresources:\n  cpus:2\n  memory: 4\n", 4, "put a space after each key's colon"),
    ("run: x\n  steps: 3\n", 2, "indent a field's fields under it"),
    ("run: x\n---\nrun: y\n", 2, "keep one document"),
    ("run: x\nsteps: *n\n", 2, "define the anchor (&NAME) before its use"),
    ('run: "python train.py\n', 2, "close the quote"),
    ("run: x\nresources: {cpus: 2\n", 3, "close the brackets"),
    ("run: !!python/object:os.system x\n", 1, "remove the tag"),
])
def test_yaml_syntax_errors_say_how_to_fix_them(tmp_path, text, line, fix):
    """Only a tab said how to fix it: "mapping values are not allowed here" or "expected <block end>" left the user
    to guess (an indentation, a missing space after a colon)."""
    msgs = errors(write(tmp_path, text))
    assert len(msgs) == 1 and msgs[0].startswith(f"{tmp_path / 'train.yaml'}:{line}: invalid YAML: "), msgs
    assert ". To fix: " in msgs[0] and fix in msgs[0].partition(". To fix: ")[2], msgs


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_file(tmp_path, text):
    path = write(tmp_path, text)
    assert errors(path) == [f"{path}:1: the file is empty. To fix: write at least 'run: python train.py'"]


def test_top_level_list(tmp_path):
    path = write(tmp_path, "- run: x\n")
    one(path, 1, "", "top level must be a mapping", "not a list")
    path = write(tmp_path, "hello\n")
    one(path, 1, "", "top level must be a mapping", "'hello'")


def test_duplicate_key(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  cpus: 4\n  use_spot: true\n  cpus: 8\n")
    one(path, 5, "resources.cpus", "duplicate key (first on line 3)")


def test_non_text_key(tmp_path):
    path = write(tmp_path, "run: x\nenvs:\n  on: 1\n")
    one(path, 3, "envs", "key 'on' is read by YAML as bool", "quote it")


def test_missing_file_and_directory(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert errors(missing) == [f"{missing}:1: file not found. To fix: check the path"]
    assert errors(tmp_path)[0].startswith(f"{tmp_path}:1: is a directory")
    assert errors(str(missing)) == [f"{missing}:1: file not found. To fix: check the path"]


def test_binary_and_undecodable(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_bytes(b"run: x\n\xff\xfe\n")
    assert errors(path) == [f"{path}:2: not UTF-8 text (byte 0xff). To fix: save the file as UTF-8"]
    path.write_bytes(b"run: x\nsteps: \x00\n")
    one(path, 2, "", "invalid YAML")


def test_hostile_yaml(tmp_path):
    cases = [
        "run: " + "[" * 3000 + "]" * 3000,                 # deeper than the parser's recursion
        "run: x\nresources:\n  regions: &r [*r]\n",        # a self-referencing list
        "run: x\nnum_nodes: " + "9" * 5000 + "\n",         # an int too long to convert
        "run: !!python/object/apply:os.system [echo]\n",   # no arbitrary objects
        "run: !!int nope\n",
        "run: x\n---\nrun: y\n",
        "run: x\n? [a, b]\n: c\n",
        "run: x\nhealth: {heartbeat_timeout: " + "9" * 400 + "}\n",
    ]
    for text in cases:
        errors(write(tmp_path, text))


def test_many_errors_one_message_per_field(tmp_path):
    path = write(tmp_path, """\
        nme: job
        num_nodes: 0
        nproc_per_node: lots
        resources:
          accelerators: [H100:8, 7]
          memory: -3
          max_hourly_cost: 0
        envs:
          9LIVES: 1
        """)
    msgs = errors(path)
    fields = [m.split(": ", 2)[1] for m in msgs]
    assert fields == ["nme", "run", "num_nodes", "nproc_per_node", "resources.accelerators",
                      "resources.memory", "resources.max_hourly_cost", "envs.9LIVES"]
    assert [int(m.split(":")[1]) for m in msgs] == [1, 1, 2, 3, 5, 6, 7, 9]


# --- bounds and control characters ------------------------------------------------------------

def _with(doc: dict, dotted: str, value) -> dict:
    """`doc` with `value` at the dotted path (sections created as needed)."""
    *sections, leaf = dotted.split(".")
    node = doc
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = value
    return doc


# (field, the largest value allowed, the same one step over)
LIMITS = [
    ("num_nodes", 4096, 4097), ("nproc_per_node", 256, 257), ("steps", 10**9, 10**9 + 1),
    ("recovery.spares", 256, 257), ("recovery.max_restarts", 1000, 1001), ("checkpoint.keep", 1000, 1001),
    ("checkpoint.interval", 10**9, 10**9 + 1), ("checkpoint.interval", "30d", "30d1s"),
    ("health.heartbeat_timeout", "24h", "24h1s"), ("resources.accelerators", "H100:64", "H100:65"),
    ("resources.accelerators", {"H100": 64}, {"H100": 65}), ("resources.cpus", "4096+", 4097),
    ("resources.memory", 65536, "65537+"), ("resources.regions", ["r"] * 64, ["r"] * 65),
    ("run", "x" * 16384, "x" * 16385), ("setup", "x" * 16384, "x" * 16385),
    ("workdir", "/" + "w" * 4095, "/" + "w" * 4096), ("checkpoint.dir", "/" + "c" * 4095, "/" + "c" * 4096),
    ("envs", {f"E{i}": "1" for i in range(128)}, {f"E{i}": "1" for i in range(129)}),
    ("envs", {"K" * 256: "1"}, {"K" * 257: "1"}), ("envs", {"V": "v" * 8192}, {"V": "v" * 8193}),
    ("kubernetes.image", "i" * 1024, "i" * 1025),
    ("kubernetes.node_selector", {f"l{i}": "v" for i in range(64)}, {f"l{i}": "v" for i in range(65)}),
    ("model.params", "1000T", "1001T"),
]
MODEL = {"params": "1B", "layers": 1, "hidden": 1, "seq_len": 1, "batch_size": 1}


@pytest.mark.parametrize("field,largest,over", LIMITS)
def test_every_count_and_size_has_an_upper_bound(tmp_path, field, largest, over):
    def doc(value):
        return _with({"run": "x", "model": dict(MODEL)}, field, value)
    load_spec(write(tmp_path, yaml.safe_dump(doc(largest))))
    path = write(tmp_path, yaml.safe_dump(doc(over)))
    [message] = errors(path)
    assert f": {field}" in message, message
    assert "To fix" in message and re.search(r"\bat most\b|\bfrom 1 to\b", message), message


def test_a_path_too_long_once_made_absolute_is_refused(tmp_path):
    path = write(tmp_path, f"run: x\nworkdir: {'w' * 4096}\n")
    [message] = errors(path)
    assert message.startswith(f"{path}:1: workdir: ") and "longer than 4096 characters once made absolute" in message


def test_a_huge_node_count_is_refused_with_its_line(tmp_path):
    path = write(tmp_path, "run: x\nnum_nodes: 99999999999999999999999999999999\n")
    one(path, 2, "num_nodes", "less than or equal to 4096", "To fix: use at most 4096")


CONTROL = ["\x00", "\x07", "\x1b", "\x7f", "\x85", "\r"]
TEXT_FIELDS = ["run", "setup", "workdir", "checkpoint.dir", "envs.SEED", "resources.regions",
               "kubernetes.image", "kubernetes.node_selector.pool", "name"]


@pytest.mark.parametrize("char", CONTROL)
@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_control_characters_are_refused_naming_the_field(tmp_path, field, char):
    value = f"a{char}b"
    path = write(tmp_path, yaml.safe_dump(_with({"run": "x"}, field, [value] if field.endswith("regions") else value)))
    [message] = errors(path)
    shown = field + "[0]" if field.endswith("regions") else field
    assert message.startswith(f"{path}:"), message
    assert f": {shown}: " in message and "To fix" in message, message
    if field != "name":        # a job name has its own pattern, which says what it may hold
        assert f"(U+{ord(char):04X}) at character 2 is not allowed here. To fix: remove it" in message


def test_control_characters_in_env_keys_and_from_the_command_line(tmp_path):
    path = write(tmp_path, 'run: x\nenvs:\n  "A\\0": 1\n')
    one(path, 3, "envs['A\\x00']", "not a valid environment variable name")
    path = write(tmp_path, "run: x\n")
    [message] = errors(path, {"MODE": "fast\x1b[2J"})
    assert message == (f"{path}:1: --env MODE: a control character (U+001B) at character 5 is not allowed here. "
                       "To fix: remove it")


def test_scripts_and_env_values_keep_tabs_and_newlines(tmp_path):
    spec = load_spec(write(tmp_path, yaml.safe_dump(
        {"run": "python a.py\tx\npython b.py", "setup": "pip install a\n\tb", "envs": {"KEY": "line1\nline2"}})))
    assert spec.run == "python a.py\tx\npython b.py" and spec.envs["KEY"] == "line1\nline2"
    path = write(tmp_path, yaml.safe_dump({"run": "x", "workdir": "a\nb"}))
    one(path, 2, "workdir", "a line break (U+000A) at character 2")


def test_a_check_refuses_a_valid_spec_at_the_line_of_its_field(tmp_path):
    path = write(tmp_path, "run: x\nresources:\n  accelerators: H100:8\n")
    assert errors(path, check=lambda spec: (("resources", "accelerators"), "resources.accelerators: no. To fix: yes")) \
        == [f"{path}:3: resources.accelerators: no. To fix: yes"]
    assert errors(path, check=lambda spec: ((), "no offer. To fix: wait")) == [f"{path}:1: no offer. To fix: wait"]
    assert load_spec(path, check=lambda spec: None).run == "x"


# --- fuzzing -----------------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def check_outcome(path):
    """Loading anything gives a JobSpec or a SpecError of one-line 'FILE:LINE: ...' messages."""
    try:
        spec = load_spec(path)
    except SpecError as err:
        assert err.messages
        for m in err.messages:
            assert len(m.splitlines()) == 1, m
            assert re.match(rf"{re.escape(str(path))}:[1-9]\d*: \S", m), m
        return None
    assert isinstance(spec, JobSpec)
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec
    return spec


@FUZZ
@given(text=st.text(max_size=300))
def test_fuzz_text(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    check_outcome(path)


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_bytes(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    check_outcome(path)


FIELDS = ["name", "num_nodes", "nproc_per_node", "workdir", "setup", "run", "envs", "steps",
          "resources", "accelerators", "cpus", "memory", "use_spot", "infra", "regions",
          "max_hourly_cost", "checkpoint", "dir", "interval", "keep", "recovery", "max_restarts",
          "spares", "health", "heartbeat_timeout", "count", "at_least", "SEED"]
WORDS = ["H100:8", "A100", "H100:zero", "auto", "30s", "1h30m", "soon", "4+", "16+", "aws", "gcp",
         "gpc", "us-east-1", "python train.py", "", "tiny-gpt", "bad name!", "-1", "0"]
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.sampled_from(WORDS) | st.text(max_size=12))
keys = st.sampled_from(FIELDS) | st.text(max_size=10)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=25)


@FUZZ
@given(doc=st.dictionaries(keys, values, max_size=8), with_run=st.booleans(),
       flow=st.booleans())
def test_fuzz_structured(tmp_path, doc, with_run, flow):
    if with_run:
        doc.setdefault("run", "python train.py")
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=flow,
                                   allow_unicode=True), encoding="utf-8")
    spec = check_outcome(path)
    if spec is not None:
        assert spec.run == doc["run"]


@FUZZ
@given(doc=st.fixed_dictionaries(
    {"run": st.just("python train.py")},
    optional={"num_nodes": scalars, "nproc_per_node": scalars, "steps": scalars,
              "envs": st.dictionaries(st.sampled_from(["SEED", "A_B", "1X", "x-y"]), scalars),
              "resources": st.fixed_dictionaries({}, optional={
                  f: values for f in ["accelerators", "cpus", "memory", "use_spot", "infra",
                                      "regions", "max_hourly_cost"]}),
              "checkpoint": st.fixed_dictionaries({}, optional={
                  f: values for f in ["dir", "interval", "keep"]}),
              "health": st.fixed_dictionaries({}, optional={"heartbeat_timeout": values})}))
def test_fuzz_near_valid(tmp_path, doc):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    check_outcome(path)


def test_kubernetes_section_and_its_bad_tolerations(tmp_path):
    path = write(tmp_path, "run: x\nkubernetes:\n  image: ghcr.io/lab/train:1\n  node_selector: {pool: a100}\n"
                           "  tolerations:\n    - {key: lab/reserved, operator: Exists, effect: NoSchedule}\n")
    spec = load_spec(path)
    assert spec.placement("kubernetes") == {
        "image": "ghcr.io/lab/train:1", "node_selector": {"pool": "a100"},
        "tolerations": [{"key": "lab/reserved", "operator": "Exists", "effect": "NoSchedule"}]}
    assert spec.placement("aws") == {}
    path = write(tmp_path, "run: x\nkubernetes:\n  tolerations:\n    - {key: a, operator: Exists, value: b}\n")
    one(path, 4, "kubernetes.tolerations[0]", "operator Exists takes no value", "To fix")
    path = write(tmp_path, "run: x\nkubernetes:\n  tolerations:\n    - {effect: Sometimes}\n")
    one(path, 4, "kubernetes.tolerations[0].effect", "NoSchedule")


@pytest.mark.parametrize("threshold, value", [("straggler_window", 10**12), ("straggler_baseline", 5000),
                                              ("gather_steps", 10**9), ("hang_min_s", ".inf"), ("gather_s", ".nan"),
                                              ("straggler_window", ".inf"), ("cooldown_steps", ".nan")])
def test_health_thresholds_that_would_exhaust_memory_or_never_fire_are_refused(tmp_path, threshold, value):
    """A whole-number threshold of .inf was an OverflowError (int(inf)): 'cannot validate the spec' at line 1, and
    a TfsnJob's create handler failing for ever, its thresholds being open in the CRD."""
    path = tmp_path / "train.yaml"
    path.write_text(f"run: python train.py\nhealth:\n  thresholds:\n    {threshold}: {value}\n")
    with pytest.raises(SpecError, match=f"health.thresholds: {threshold}: must be"):
        load_spec(path)


@pytest.mark.parametrize("thresholds", ["{phase_timeout_max_s: 1, phase_timeout_min_s: 100}",
                                        "{phase_timeout_max_s: 60}"])     # under the shipped minimum, 120 s
def test_a_phase_timeout_ceiling_below_its_floor_is_refused(tmp_path, thresholds):
    """phase_timeout_max_s under phase_timeout_min_s was accepted: every save, eval and first step past the
    ceiling became a hang (with the first-step rule, every attempt of a job that compiles for a minute)."""
    path = tmp_path / "train.yaml"
    path.write_text(f"run: python train.py\nhealth:\n  thresholds: {thresholds}\n")
    with pytest.raises(SpecError, match="health.thresholds: phase_timeout_max_s .* is below phase_timeout_min_s .* "
                                        "To fix: make phase_timeout_max_s at least phase_timeout_min_s"):
        load_spec(path)


ACCEPTED_IDENTITIES = {
    "aws": ["tfsn-node", "team+ml=prod,x.y@z-1", "arn:aws:iam::123456789012:instance-profile/tfsn-node",
            "arn:aws:iam::123456789012:instance-profile/team/ml/tfsn-node",
            "arn:aws-cn:iam::123456789012:instance-profile/tfsn-node"],
    "gcp": ["tfsn-node@lab-123.iam.gserviceaccount.com", "123456789012-compute@developer.gserviceaccount.com"],
    "azure": ["/subscriptions/00000000-0000-4000-8000-0000000000aa/resourceGroups/ids/providers/"
              "Microsoft.ManagedIdentity/userAssignedIdentities/tfsn-node",
              "/subscriptions/00000000-0000-4000-8000-0000000000AA/resourcegroups/My.Group(1)/providers/"
              "microsoft.managedidentity/userassignedidentities/tfsn_node"],
}
REFUSED_IDENTITIES = [
    ("aws", "arn:aws:iam::123456789012:role/tfsn-node", "ARN of an IAM role, not of an instance profile"),
    ("aws", "tfsn node", "not an IAM instance profile name or ARN"),
    ("aws", "arn:aws:iam::12345:instance-profile/x", "not an IAM instance profile name or ARN"),
    ("gcp", "tfsn-node", "not a service account email"),
    ("gcp", "someone@gmail.com", "not a service account email"),
    ("azure", "tfsn-node", "not a user-assigned managed identity's resource ID"),
    ("azure", "/subscriptions/00000000-0000-4000-8000-0000000000aa/resourceGroups/ids/providers/"
              "Microsoft.Compute/virtualMachines/vm", "not a user-assigned managed identity's resource ID"),
]


def test_remote_identity_keeps_each_clouds_value_and_round_trips(tmp_path):
    for cloud, values in ACCEPTED_IDENTITIES.items():
        for value in values:
            spec = load_spec(write(tmp_path, f"run: x\nresources:\n  remote_identity:\n    {cloud}: '{value}'\n"))
            assert spec.resources.identity(cloud) == value
            assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
            assert {other: spec.resources.identity(other) for other in ACCEPTED_IDENTITIES if other != cloud} == {
                other: "" for other in ACCEPTED_IDENTITIES if other != cloud}
    assert load_spec(write(tmp_path, "run: x\n")).resources.identity("aws") == ""
    assert load_spec(write(tmp_path, "run: x\n")).resources.identity("kubernetes") == ""


@pytest.mark.parametrize("cloud, value, needle", REFUSED_IDENTITIES)
def test_a_malformed_remote_identity_names_the_field_and_the_fix(tmp_path, cloud, value, needle):
    path = write(tmp_path, f"run: x\nresources:\n  remote_identity:\n    {cloud}: '{value}'\n")
    one(path, 4, f"resources.remote_identity.{cloud}", needle, "To fix: write", "e.g.")
    path = write(tmp_path, "run: x\nresources:\n  remote_identity:\n    oci: x\n")
    one(path, 4, "resources.remote_identity.oci", "unknown field 'oci'", "aws, gcp, azure")


@pytest.mark.parametrize("cloud", sorted(KINDS))
def test_the_fix_a_malformed_remote_identity_suggests_is_itself_accepted(tmp_path, cloud):
    """The error's "e.g." is what a user copies: Azure's said SUBSCRIPTION where a GUID is required."""
    for example in KINDS[cloud].example.split(" or "):
        spec = load_spec(write(tmp_path, f"run: x\nresources:\n  remote_identity:\n    {cloud}: '{example}'\n"))
        assert spec.resources.identity(cloud) == example
