"""Bad input at the command line: one clear line, a non-zero exit, no traceback, nothing lost."""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli.main import main
from orchestrator.control import daemon
from orchestrator.control.store import JobState, Store
from orchestrator.spec import JobSpec
from tests.conftest import EXAMPLE, ROOT, write_job


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("tfsn: error: ") for line in lines), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_validate_names_file_line_and_field(tfsn, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("name: x\nrun: python train.py\nresources:\n  acelerators: H100:8\n")
    proc = tfsn("validate", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:4:", "resources.acelerators", "did you mean 'accelerators'")


def test_launch_of_a_bad_file_saves_nothing_and_keeps_existing_jobs(tfsn, tmp_path):
    store = Store(tfsn.home / "tfsn.db")
    earlier = store.create_job("earlier", {"name": "earlier", "num_nodes": 1}, "x.yaml", "t")
    store.transition(earlier.id, JobState.STOPPED, "by user")
    before = json.loads(tfsn("status", "--json").stdout)
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    proc = tfsn("launch", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:", "invalid YAML")
    after = json.loads(tfsn("status", "--json").stdout)
    assert [j["id"] for j in after] == [earlier.id]
    assert after[0]["state"] == before[0]["state"] == "STOPPED"


def test_launch_asking_for_a_gpu_on_this_machine_says_how_to_fix(tfsn, tmp_path):
    spec = write_job(tmp_path / "gpu.yaml", steps=1, resources={"accelerators": "H100:8"})
    proc = tfsn("launch", str(spec), check=False)
    assert_one_line_error(proc, "H100:8", "To fix")
    assert json.loads(tfsn("status", "--json").stdout) == []


# A Ctrl-C whose handler runs in a garbage collector's callback or a __del__ (as importing the CLI's modules runs weakref
# callbacks): Python prints "Exception ignored" and drops the KeyboardInterrupt. It comes while the CLI is imported, or
# as `tfsn launch` finishes planning.
LOST_CTRL_C = """\
import gc, os, signal, sys
import tfsn

signal.signal(signal.SIGINT, signal.default_int_handler)   # a terminal's Ctrl-C, even under `cmd &`
sent = []

def ctrl_c():
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)

if sys.argv[1] == "import":
    gc.callbacks.append(lambda phase, info: "orchestrator.cli.main" in sys.modules and ctrl_c())
else:
    import orchestrator.cli.main as cli
    planned = cli.checked_spec

    class Freed:
        def __del__(self):
            ctrl_c()

    def checked_spec(*args, **kwargs):
        spec = planned(*args, **kwargs)
        Freed()
        return spec

    cli.checked_spec = checked_spec
sys.argv = ["tfsn", *sys.argv[2:]]
tfsn.main()
"""


@pytest.mark.parametrize("when", ["import", "planning"])
def test_a_ctrl_c_that_python_dropped_still_stops_a_launch_before_it_submits(tfsn, tmp_path, when):
    """Ctrl-C at the second `tfsn launch` started printed "Exception ignored in: <function _get_module_lock.<locals>.cb>
    ... KeyboardInterrupt", and the launch went on: the job was submitted and ran to the end."""
    spec = tmp_path / "job.yaml"
    spec.write_text("run: 'true'\nsteps: 1\n")
    proc = subprocess.run([sys.executable, "-c", LOST_CTRL_C, when, "launch", "--detach", str(spec)], env=tfsn.env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Exception ignored" in proc.stderr and "KeyboardInterrupt" in proc.stderr     # Python did drop it
    assert proc.returncode == 130 and "submitted" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.rstrip().endswith("tfsn: interrupted"), proc.stderr      # said, as later Ctrl-Cs are
    assert json.loads(tfsn("status", "--json").stdout) == []
    assert tfsn("launch", "--detach", str(spec)).returncode == 0       # and nothing keeps a relaunch from starting it


def test_missing_file_and_bad_env_pair(tfsn, tmp_path):
    assert_one_line_error(tfsn("launch", str(tmp_path / "nope.yaml"), check=False), "nope.yaml")
    assert_one_line_error(tfsn("launch", str(EXAMPLE / "train.yaml"), "--env", "NOEQUALS", check=False),
                          "KEY=VALUE")


def test_validate_takes_env_pairs_as_launch_does_which_its_message_about_an_unset_variable_suggests(in_process,
                                                                                                    tmp_path):
    (tmp_path / "code").mkdir()
    spec = tmp_path / "train.yaml"
    spec.write_text("run: python train.py\nworkdir: code\ncheckpoint:\n  dir: $TFSN_TEST_CKPT/run1\n")
    code, out, err = in_process("validate", str(spec))
    assert code == 2 and "--env TFSN_TEST_CKPT=" in err
    code, out, err = in_process("validate", str(spec), "--env", f"TFSN_TEST_CKPT={tmp_path}/ckpt")
    assert (code, err) == (0, "") and "valid job 'train'" in out
    code, out, err = in_process("validate", str(spec), "--env", "NOEQUALS")
    assert code == 2 and err == "tfsn: error: --env 'NOEQUALS': expected KEY=VALUE. To fix: e.g. --env SEED=1\n"


def test_unknown_job_in_status_logs_stop(tfsn):
    for command in ("status", "logs", "stop"):
        assert_one_line_error(tfsn(command, "ghost", check=False), "ghost", "tfsn ls")


def test_bad_health_policy_names_line_and_suggests(tfsn, tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("run: python train.py\nhealth:\n  thresholds:\n    straggler_min_slowdwn: 0.1\n"
                   "  actions:\n    straggler: explode\n")
    proc = tfsn("validate", str(bad), check=False)
    assert_one_line_error(proc, f"{bad}:3: health.thresholds", "did you mean 'straggler_min_slowdown'",
                          f"{bad}:5: health.actions", "explode")


def test_health_simulate_reports_detection_as_json(tfsn):
    out = tfsn("health", "simulate", "--ranks", "64", "--steps", "150", "--throttle-rank", "5",
               "--slowdown", "0.3", "--onset", "90", "--seed", "1", "--json")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["detected"] and result["blamed"] == [5] and result["false_positives"] == 0
    assert 0 < result["detection_delay_steps"] <= 20 and 0 < result["ettr"] <= 1


def test_bad_name_and_job_refs_are_one_line_errors(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=1)
    assert_one_line_error(tfsn("launch", str(spec), "--name", "bad name!", check=False), "--name")
    assert_one_line_error(tfsn("launch", str(spec), "--name", "7", check=False), "--name '7'", "job id")
    assert json.loads(tfsn("status", "--json").stdout) == []
    for ref in ("99999999999999999999999", "²"):
        assert_one_line_error(tfsn("status", ref, check=False), "no job")


def test_missing_workdir_is_refused_before_anything_runs(tfsn, tmp_path):
    spec = write_job(tmp_path / "job.yaml", steps=1, workdir=str(tmp_path / "nowhere"))
    assert_one_line_error(tfsn("launch", str(spec), check=False), "nowhere", "To fix")
    assert json.loads(tfsn("status", "--json").stdout) == []


# ---- issue 17: bounded specs, and `tfsn validate` refuses what `tfsn launch` refuses -----------------

NOT_LAUNCHABLE = [
    ("num_nodes: 99999999999999999999999999999999\n", "num_nodes: input should be less than or equal to 4096"),
    ('envs:\n  SEED: "1\\0"\n', "envs.SEED: a control character (U+0000)"),
    ("resources:\n  accelerators: FOO:8\n  infra: [aws]\n", "resources.accelerators: unknown accelerator 'FOO'"),
    ("resources:\n  accelerators: H10:8\n", "did you mean 'H100'?"),
    ("workdir: nowhere\n", "workdir: "),
    ("num_nodes: 4096\n", "num_nodes 4096: this machine runs at most"),   # no cloud: 4096 local agents
    ("nproc_per_node: 256\n", "train.yaml:3: no capable offer: nproc_per_node 256 on 1 node(s) is 256 workers"),
    # clouds allowed, but a CPU job fits only this machine: its limit is the cause, not the clouds' GPUs
    ("nproc_per_node: 256\nresources:\n  infra: [local, aws]\n", "train.yaml:3: no capable offer: nproc_per_node 256"),
    ("resources:\n  memory: 4000\n", "train.yaml:4: no capable offer: resources.memory 4000"),   # its line, not 1
    # a job that could never save (it failed at its first checkpoint, and again after a restart)
    ("checkpoint:\n  dir: ../train.yaml\n", "train.yaml is a file, not a folder"),
    ("checkpoint:\n  dir: ../train.yaml/ckpt\n", "ckpt is below "),
    # root's permission bits say yes and the filesystem says no (was taken, as root)
    ("checkpoint:\n  dir: /proc/tfsn-ckpt\n", "cannot write in /proc"),
    # a folder name over the filesystem's 255 bytes: lexists() says "missing" (ENAMETOOLONG), so it was taken
    ("checkpoint:\n  dir: " + "c" * 256 + "\n", "a folder name of 256 bytes"),
    ("checkpoint:\n  dir: new/" + "\u00e9" * 128 + "/ckpt\n", "a folder name of 256 bytes"),   # 128 characters
]


@pytest.mark.parametrize("extra, needle", NOT_LAUNCHABLE)
def test_validate_refuses_what_launch_refuses_with_the_same_line(tfsn, tmp_path, extra, needle):
    (tmp_path / "code").mkdir()
    spec = tmp_path / "train.yaml"
    spec.write_text("run: python train.py\nworkdir: code\n" + extra)
    checked = tfsn("validate", str(spec), check=False)
    launched = tfsn("launch", "--detach", str(spec), check=False)
    assert_one_line_error(checked, f"{spec}:", needle, "To fix")
    assert launched.returncode == 2 and launched.stderr == checked.stderr
    assert json.loads(tfsn("status", "--json").stdout) == []


def _in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`tfsn ARGS` through the console entry point, in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tfsn", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


GOOD = "python train.py"
FUZZ_SPEC = st.fixed_dictionaries({"run": st.sampled_from([GOOD, GOOD, "python\ttrain.py\n", "x\x00y", "a" * 16385])},
                                  optional={
    "num_nodes": st.integers(1, 8) | st.integers(-1, 5000) | st.just(10**32),
    "nproc_per_node": st.sampled_from(["auto", 0, 8, 256, 257]),
    "steps": st.integers(1, 1000) | st.integers(0, 2 * 10**9),
    "workdir": st.sampled_from(["code", "code", "nowhere", "code\x01", "/" + "w" * 4096]),
    "envs": st.dictionaries(st.sampled_from(["SEED", "MODE", "1X", "A\x00"]),
                            st.sampled_from(["1", "line\nline", "a\x1bb", "v" * 8193]), max_size=2),
    "resources": st.fixed_dictionaries({}, optional={
        "accelerators": st.sampled_from(["H100:8", "FOO:8", "h10:1", "A100:65", {"T4": 4, "BAR": 1},
                                         ["T4:4", "H100:8"]]),
        "infra": st.sampled_from([["local"], ["aws"], ["gcp", "aws"]]),
        "cpus": st.sampled_from(["1+", "1+", 5000])}),
    "checkpoint": st.fixed_dictionaries({}, optional={"keep": st.integers(0, 1001),
                                                      "interval": st.sampled_from(["auto", "10m", "31d", 10**9 + 1])}),
    "recovery": st.fixed_dictionaries({}, optional={"max_restarts": st.integers(0, 1001),
                                                    "spares": st.integers(0, 257)}),
})


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=FUZZ_SPEC)
def test_fuzz_validate_accepts_and_refuses_exactly_what_launch_does(tmp_path, monkeypatch, capsys, doc):
    monkeypatch.setenv("TFSN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))      # the shipped catalog, not a refreshed one
    monkeypatch.setenv("HOME", str(tmp_path))                       # nor SkyPilot's
    monkeypatch.delenv("TFSN_CLOUDS", raising=False)
    monkeypatch.setattr(daemon, "ensure_controller", lambda: {})    # a job accepted is stored, never run
    (tmp_path / "code").mkdir(exist_ok=True)
    spec = tmp_path / "fuzz.yaml"
    spec.write_text(yaml.safe_dump(doc))
    code, out, err = _in_process(monkeypatch, capsys, "validate", str(spec))
    launch_code, launch_out, launch_err = _in_process(monkeypatch, capsys, "launch", "--detach", str(spec))
    assert (code, err) == (launch_code, launch_err), (doc, err, launch_err)
    if code == 0:
        assert "valid job" in out and "submitted" in launch_out
        return
    assert code == 2 and "Traceback" not in out + err
    lines = err.splitlines()
    assert lines and all(re.match(rf"tfsn: error: {re.escape(str(spec))}:\d+: \S.*To fix", line) for line in lines), err


# ---- issue 16: a cloud job's checkpoints must outlive its nodes ----------------------------------------------

NODE_LOCAL_CHECKPOINTS = [
    ("aws", "checkpoint:\n  dir: /data/ckpt\n", "s3://BUCKET/PATH", 7),
    ("gcp", "", "gs://BUCKET/PATH", 5),                        # unset: the controller's disk; infra is to blame
    ("azure", "checkpoint:\n  keep: 2\n", "az://CONTAINER/PATH", 5),
]


@pytest.mark.parametrize("cloud, section, url, line", NODE_LOCAL_CHECKPOINTS)
def test_cloud_job_with_node_local_checkpoints_is_refused(tfsn, tmp_path, cloud, section, url, line):
    (tmp_path / "code").mkdir()
    spec = tmp_path / "train.yaml"
    head = f"run: python train.py\nworkdir: code\nresources:\n  accelerators: A100:8\n  infra: [{cloud}]\n"
    spec.write_text(head + section)
    checked = tfsn("validate", str(spec), check=False)
    assert_one_line_error(checked, f"{spec}:{line}: checkpoint.dir: ", f"not storage that {cloud} nodes share",
                          f"To fix: set checkpoint.dir to {url}", "checkpoint.local_ok: true")
    launched = tfsn("launch", "--detach", str(spec), check=False)
    assert launched.returncode == 2 and launched.stderr == checked.stderr
    assert json.loads(tfsn("status", "--json").stdout) == []

    spec.write_text(head + f"checkpoint:\n  dir: {url.replace('BUCKET', 'b').replace('CONTAINER', 'c')}\n")
    assert "valid job" in tfsn("validate", str(spec)).stdout      # an object store: accepted
    spec.write_text(head + "checkpoint:\n  dir: /shared/ckpt\n  local_ok: true\n")
    assert "valid job" in tfsn("validate", str(spec)).stdout      # the user vouches for a shared mount


def test_multi_node_local_job_keeps_its_default_checkpoints(tfsn):
    """The README's example (2 nodes on this machine, no checkpoint.dir) stays valid: its nodes share the disk."""
    assert "valid job 'tiny-gpt': 2 node(s)" in tfsn("validate", str(EXAMPLE / "train.yaml")).stdout


def test_enabled_clouds_need_shared_checkpoints_too(tfsn):
    tfsn.env["TFSN_CLOUDS"] = "aws"
    proc = tfsn("validate", str(EXAMPLE / "train.yaml"), check=False)
    assert_one_line_error(proc, "checkpoint.dir: unset", "not storage that aws nodes share",
                          "or resources.infra: [local] to run on this machine only")


# ---- issue 16: a cloud VM reaches the job's bucket as the identity it runs as ---------------------------------

IDENTITIES = [
    ("aws", "s3://lab-ckpt/run1", "arn:aws:iam::123456789012:instance-profile/tfsn-node"),
    ("gcp", "gs://lab-ckpt/run1", "tfsn-node@lab.iam.gserviceaccount.com"),
    ("azure", "az://ckpt/run1", "/subscriptions/00000000-0000-4000-8000-0000000000aa/resourceGroups/ids/providers/"
                                "Microsoft.ManagedIdentity/userAssignedIdentities/tfsn-node"),
]


def _cloud_job(tmp_path, infra: str, url: str, extra: str = "") -> str:
    (tmp_path / "code").mkdir(exist_ok=True)
    spec = tmp_path / "train.yaml"
    spec.write_text(f"run: python train.py\nworkdir: code\nresources:\n  accelerators: A100:8\n  infra: [{infra}]\n"
                    f"{extra}checkpoint:\n  dir: {url}\n")
    return str(spec)


@pytest.fixture
def in_process(tmp_path, monkeypatch, capsys):
    """`tfsn ARGS` in this process, with a store of its own and no controller (a job launched is only stored)."""
    monkeypatch.setenv("TFSN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TFSN_CLOUDS", raising=False)
    monkeypatch.setattr(daemon, "ensure_controller", lambda: {})
    return lambda *args: _in_process(monkeypatch, capsys, *args)


@pytest.mark.parametrize("cloud, url, identity", IDENTITIES)
def test_a_bucket_on_a_cloud_whose_vms_have_no_identity_is_a_warning_naming_the_field(in_process, tmp_path, cloud,
                                                                                       url, identity):
    spec = _cloud_job(tmp_path, cloud, url)
    code, out, err = in_process("validate", spec)
    assert code == 0 and "valid job" in out                     # a warning, not a refusal: images may hold keys
    [line] = err.splitlines()
    assert line.startswith(f"tfsn: warning: {spec}:3: resources.remote_identity.{cloud} is unset: ")
    assert url in line and "To fix: set it to" in line
    launched = in_process("launch", "--detach", spec)
    assert launched[0] == 0 and launched[2] == err              # launch says the same, and goes on

    spec = _cloud_job(tmp_path, cloud, url, f"  remote_identity:\n    {cloud}: {identity}\n")
    assert in_process("validate", spec)[::2] == (0, "")


def test_vms_of_another_cloud_than_the_buckets_are_warned_unless_envs_carry_credentials(in_process, tmp_path):
    spec = _cloud_job(tmp_path, "aws, gcp", "s3://lab-ckpt/run1", "  remote_identity: {gcp: x@p.iam.gserviceaccount.com}\n")
    code, _, err = in_process("validate", spec)
    assert code == 0
    aws, gcp = err.splitlines()
    assert "resources.remote_identity.aws is unset" in aws
    assert gcp.startswith(f"tfsn: warning: {spec}:8: checkpoint.dir: gcp VMs have no credentials for s3://lab-ckpt/")
    assert "To fix: give s3:// credentials in envs (AWS_ACCESS_KEY_ID)" in gcp
    (tmp_path / "train.yaml").write_text((tmp_path / "train.yaml").read_text() + "envs: {AWS_ACCESS_KEY_ID: AKIA}\n")
    assert in_process("validate", spec)[::2] == (0, "")


def test_a_malformed_identity_is_refused_naming_the_field_and_the_fix(tfsn, tmp_path):
    spec = _cloud_job(tmp_path, "aws", "s3://lab-ckpt/run1", (
        "  remote_identity:\n    aws: arn:aws:iam::123456789012:role/tfsn-node\n    gcp: tfsn-node\n"
        "    azure: /subscriptions/00000000-0000-4000-8000-0000000000aa/resourceGroups/ids/providers/"
        "Microsoft.Compute/virtualMachines/vm\n"))
    proc = tfsn("validate", spec, check=False)
    assert_one_line_error(proc, f"{spec}:7: resources.remote_identity.aws: ", "ARN of an IAM role, not of an instance "
                          "profile", f"{spec}:8: resources.remote_identity.gcp: 'tfsn-node' is not a service account",
                          f"{spec}:9: resources.remote_identity.azure: ", "userAssignedIdentities/tfsn-node")
    assert len(proc.stderr.splitlines()) == 3 and proc.stderr.count("To fix:") == 3
    launched = tfsn("launch", "--detach", spec, check=False)
    assert launched.returncode == 2 and launched.stderr == proc.stderr
    assert json.loads(tfsn("status", "--json").stdout) == []


# ---- two live jobs must not share a checkpoint folder ---------------------------------------------------------

def test_a_second_live_job_saving_into_the_same_checkpoint_dir_is_refused_naming_the_first(in_process, tmp_path):
    """Two jobs launched with one checkpoint.dir restored each other's half-trained steps, pruned each other's
    checkpoints and failed on "Directory not empty" when both saved one step: the second launch is refused."""
    (tmp_path / "code").mkdir()
    first, other = tmp_path / "train.yaml", tmp_path / "code" / "again.yaml"
    first.write_text("run: python train.py\nworkdir: code\ncheckpoint:\n  dir: ckpt\n")
    other.write_text("run: python train.py\ncheckpoint:\n  keep: 2\n  dir: ./ckpt/\n")   # the same folder, other words
    assert in_process("launch", "--detach", str(first))[0] == 0
    code, out, err = in_process("launch", "--detach", str(other))
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"tfsn: error: {other}:4: checkpoint.dir: {tmp_path / 'code' / 'ckpt'} is in use by job 1 ")
    assert "To fix: stop it first (tfsn stop 1)" in line
    store = Store(tmp_path / "home" / "tfsn.db")
    assert [j.id for j in store.jobs()] == [1]                 # nothing stored for the refused launch

    store.transition(1, JobState.STOPPED, "by user")            # once the first has ended, its folder is free
    assert in_process("launch", "--detach", str(other))[0] == 0
    (tmp_path / "code" / "default.yaml").write_text("run: python train.py\n")   # each its own default folder
    assert [in_process("launch", "--detach", str(tmp_path / "code" / "default.yaml"))[0] for _ in "ab"] == [0, 0]


def test_stop_by_name_stops_the_live_job_of_that_name_and_refuses_to_guess_between_several(in_process, tmp_path):
    """`tfsn stop NAME` took the newest job of the name: with it ended, it said "job 2 already STOPPED" while job 1 of
    that name ran on (on a cloud, billed on)."""
    (tmp_path / "home").mkdir()
    store = Store(daemon.store_path(tmp_path / "home"))
    older, newer = (store.create_job("train", {"name": "train"}, "t.yaml", "t") for _ in range(2))
    store.transition(newer.id, JobState.STOPPED, "by user")
    code, out, err = in_process("stop", "train", "--no-wait")
    assert (code, err) == (0, "") and f"job {older.id}: stop requested" in out
    assert store.job(older.id).stop_requested
    third = store.create_job("train", {"name": "train"}, "t.yaml", "t")
    code, out, err = in_process("stop", "train")
    assert code == 2 and err == (f"tfsn: error: 2 live jobs are named 'train' (ids {older.id}, {third.id}). To fix: "
                                 f"stop each by its id, e.g. tfsn stop {third.id}\n")
    assert not store.job(third.id).stop_requested


def test_logs_of_a_job_without_a_log_says_so(in_process, tmp_path):
    """`tfsn logs 1` of a job not started yet (or failed before any node) printed nothing, as if it had run silent."""
    (tmp_path / "home").mkdir()
    job = Store(daemon.store_path(tmp_path / "home")).create_job("train", {"name": "train"}, "t.yaml", "t")
    code, out, err = in_process("logs", str(job.id))
    assert (code, out) == (0, "") and err == f"tfsn: job {job.id} (PENDING) has no log yet. See: tfsn status {job.id}\n"


def test_a_heartbeat_timeout_of_a_few_heartbeats_is_a_warning_naming_the_field(in_process, tmp_path):
    """heartbeat_timeout: 1s was accepted without a word, and failed both healthy nodes of a local job as it
    started: a restart and two new nodes for nothing."""
    (tmp_path / "code").mkdir()
    spec = tmp_path / "train.yaml"
    spec.write_text("run: python train.py\nworkdir: code\nhealth:\n  heartbeat_timeout: 1s\n")
    code, out, err = in_process("validate", str(spec))
    assert code == 0 and "valid job" in out
    [line] = err.splitlines()
    assert line.startswith(f"tfsn: warning: {spec}:4: health.heartbeat_timeout: 1s is a few heartbeats ")
    assert "To fix: 10s or more" in line
    assert in_process("launch", "--detach", str(spec))[::2] == (0, err)
    spec.write_text("run: python train.py\nworkdir: code\nhealth:\n  heartbeat_timeout: 10s\n")
    assert in_process("validate", str(spec))[::2] == (0, "")


@pytest.mark.parametrize("args", [("ls",), ("status", "1"), ("controller", "start"), ("controller", "stop"),
                                  ("controller", "status"), ("launch", "SPEC")])
def test_a_tfsn_home_that_cannot_be_used_is_one_line_naming_it(tfsn, tmp_path, args):
    """TFSN_HOME set to a file, or holding a tfsn.db that is not a store, ended every command in a traceback."""
    home_file = tmp_path / "not-a-folder"
    home_file.write_text("")
    (tmp_path / "train.yaml").write_text("run: python train.py\n")
    args = tuple(str(tmp_path / "train.yaml") if a == "SPEC" else a for a in args)
    tfsn.env["TFSN_HOME"] = str(home_file)
    assert_one_line_error(tfsn(*args, check=False), f"TFSN_HOME {home_file} is a file", "To fix: set TFSN_HOME")
    if args[0] == "controller":
        return                                  # no store opened
    tfsn.env["TFSN_HOME"] = str(tmp_path)
    (tmp_path / "tfsn.db").write_text("my notes, not a database\n" * 100)
    assert_one_line_error(tfsn(*args, check=False), f"{tmp_path / 'tfsn.db'}: cannot open tfsn's store",
                          "To fix: move the file away")
    assert (tmp_path / "tfsn.db").read_text() == "my notes, not a database\n" * 100     # left as it was


def test_a_followed_job_whose_controller_died_gets_it_back(in_process, tmp_path, monkeypatch):
    """The controller of a foreground `tfsn launch` was killed: the launch showed nothing more and never ended
    while the workers trained on unwatched, and its Ctrl-C waited 120 s for a stop no one acted on, then said
    'job 24 RUNNING'. The launch now starts a controller again (which takes the job back), as `status` does."""
    from orchestrator.cli import view
    monkeypatch.setattr(view, "KEEP_ALIVE_S", 0.2)
    monkeypatch.setattr(daemon, "read_info", lambda home: None)             # no controller answers
    (tmp_path / "home").mkdir()
    store = Store(tmp_path / "home" / "tfsn.db")
    started = []

    def start_controller() -> dict:            # the first start is the launch's own; a later one takes the job back
        started.append(time.monotonic())
        if len(started) > 1:
            store.transition(1, JobState.STOPPED, "stopped by the user")
        return {}
    monkeypatch.setattr(daemon, "ensure_controller", start_controller)
    (tmp_path / "train.yaml").write_text("run: python train.py\n")
    code, out, err = in_process("launch", str(tmp_path / "train.yaml"))
    assert code == 1 and "job 1 STOPPED" in out and len(started) == 2, (code, out, err)
    assert err == "tfsn: the controller had stopped; starting it again (running jobs carry on)\n"


@pytest.mark.parametrize("detach", [False, True])
def test_a_ctrl_c_while_the_launchs_controller_starts_stops_the_job(in_process, tmp_path, monkeypatch, detach):
    """Ctrl-C a second into `tfsn launch` (the job stored, its controller starting) printed nothing and exited,
    and the job trained on unseen: only a Ctrl-C once 'Ctrl-C stops it' was printed stopped it."""
    monkeypatch.setattr(daemon, "read_info", lambda home: None)             # no controller answers yet
    (tmp_path / "home").mkdir()
    store = Store(tmp_path / "home" / "tfsn.db")
    started = []

    def start_controller() -> dict:            # the user's Ctrl-C lands in the launch's own start of it
        started.append(time.monotonic())
        if len(started) == 1:
            raise KeyboardInterrupt
        if store.job(1).stop_requested:        # the controller started again acts on the stop
            store.transition(1, JobState.STOPPED, "stopped by the user")
        return {}
    monkeypatch.setattr(daemon, "ensure_controller", start_controller)
    (tmp_path / "train.yaml").write_text("run: python train.py\n")
    code, out, err = in_process("launch", *(["--detach"] if detach else []), str(tmp_path / "train.yaml"))
    assert code == 1 and "stopping job 1..." in out and "job 1 STOPPED" in out, (code, out, err)
    assert store.job(1).state == JobState.STOPPED


def read_only_run(tfsn, *args: str) -> subprocess.CompletedProcess:
    """`tfsn ARGS` with TFSN_HOME read-only: a read-only bind mount in a mount namespace of its own for root (whom
    no mode bit stops), else the folder's and its files' write bits cleared."""
    cli = [sys.executable, str(ROOT / "tfsn.py"), *args]
    if os.geteuid() != 0:
        for path in [tfsn.home, *tfsn.home.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        try:
            return subprocess.run(cli, env=tfsn.env, capture_output=True, text=True, timeout=60)
        finally:
            for path in [tfsn.home, *tfsn.home.rglob("*")]:
                path.chmod(path.stat().st_mode | 0o200)
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", mount, str(tfsn.home), *cli], env=tfsn.env,
                          capture_output=True, text=True, timeout=60)
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"no read-only mount here: {proc.stderr.strip()}")
    return proc


def test_a_read_only_tfsn_home_shows_its_jobs_and_refuses_changes_in_one_line(tfsn, tmp_path):
    """A read-only (or full) TFSN_HOME ended every command in a traceback: ls and status in OSError: [Errno 30]
    Read-only file system (the store's chmod, then the controller's log), launch and stop in sqlite3's
    OperationalError. Reading still works, with a warning that the controller cannot start; a change is one line."""
    tfsn.home.chmod(0o700)                                     # as tfsn makes it
    store = Store(tfsn.home / "tfsn.db")
    spec = JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json")
    job = store.create_job("j", spec, "train.yaml", "token")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING)                 # live, and no controller runs for it
    store._db.close()
    (tmp_path / "train.yaml").write_text("run: python train.py\n")
    for args in (("ls",), ("status", "1", "--json")):
        proc = read_only_run(tfsn, *args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert "tfsn: warning: cannot start the controller: " in proc.stderr and "To fix:" in proc.stderr
    assert json.loads(proc.stdout)["state"] == "RUNNING"
    for args in (("launch", "--detach", str(tmp_path / "train.yaml")), ("stop", "1"), ("controller", "start")):
        proc = read_only_run(tfsn, *args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        [line] = proc.stderr.splitlines()
        assert line.startswith("tfsn: error: ") and "To fix:" in line, line
    assert Store(tfsn.home / "tfsn.db").job(job.id).state == JobState.RUNNING    # nothing lost


def test_a_full_disk_under_tfsn_home_says_so_and_not_to_move_the_store_away(tfsn, tmp_path):
    """A store that SQLite could not write for want of space was called unreadable: "To fix: move the file away
    (tfsn starts an empty store)", which hides every job it holds, and the disk stays full. The disk is full here
    as far as the command can tell: no file of it may grow (RLIMIT_FSIZE; SQLite gets EFBIG)."""
    store = Store(tfsn.home / "tfsn.db")
    store.create_job("j", JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json"), "t.yaml", "t")
    store._db.close()
    full = subprocess.run([sys.executable, str(ROOT / "tfsn.py"), "status"], env=tfsn.env, capture_output=True,
                          text=True, timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr
    [line] = full.stderr.splitlines()
    assert line.startswith("tfsn: error: ") and "disk is full or failing" in line and "free space" in line, line
    assert "move the file away" not in line
    assert [job["name"] for job in json.loads(tfsn("status", "--json").stdout)] == ["j"]     # nothing lost


def test_logs_of_a_long_jobs_log_are_copied_in_bounded_memory(tfsn):
    """`tfsn logs` read the whole log at once, which grows to 4 GiB (MAX_JOB_LOG_BYTES): twice its size in memory
    (1.1 GB of RSS for a 560 MB log), before printing a byte."""
    store = Store(tfsn.home / "tfsn.db")
    job = store.create_job("j", JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json"), "t", "t")
    log = tfsn.home / "jobs" / str(job.id) / "job.log"
    log.parent.mkdir(parents=True)
    line = b"[rank0]: step 1: loss 2.6576, 30 ms/step, 8,451 tok/s " + b"x" * 200 + b"\n"
    with open(log, "wb") as f:
        for _ in range(256):
            f.write(line * 1024)             # 64 MiB in all
        f.write(b"caf\xe9 the last line\n")
    # `tfsn logs`, then its peak RSS in KiB on stderr (VmHWM: ru_maxrss would be pytest's, kept across exec)
    measured = ("import re, sys, tfsn\nsys.argv[0] = 'tfsn'\ntry:\n    tfsn.main()\nfinally:\n"
                "    print(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read())[1], file=sys.stderr)")
    with open(tfsn.home / "out.txt", "wb") as out:
        proc = subprocess.run([sys.executable, "-c", measured, "logs", str(job.id)], env=tfsn.env, cwd=ROOT,
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stderr.split()[-1]) < 128 * 1024, proc.stderr               # KiB: 128 MiB for 64 MiB of log
    shown = tfsn.home / "out.txt"
    assert shown.stat().st_size == log.stat().st_size + 2                       # 0xe9 is U+FFFD, 3 bytes
    with open(shown, "rb") as f:
        f.seek(-100, os.SEEK_END)
        assert f.read().endswith("caf\ufffd the last line\n".encode())


def test_stop_without_waiting_says_the_stop_was_requested(in_process, tmp_path):
    """`tfsn stop --no-wait 1` printed "job 1 RUNNING", as if the stop had been ignored."""
    (tmp_path / "home").mkdir()
    store = Store(tmp_path / "home" / "tfsn.db")
    job = store.create_job("j", JobSpec.model_validate({"name": "j", "run": "true"}).model_dump(mode="json"), "t", "t")
    store.transition(job.id, JobState.PROVISIONING)
    store.transition(job.id, JobState.RUNNING)
    code, out, err = in_process("stop", "--no-wait", str(job.id))
    assert code == 0 and out.strip() == f"job {job.id}: stop requested (it was RUNNING). Follow: tfsn status {job.id}"
    assert store.job(job.id).stop_requested


@pytest.mark.parametrize("below", ["", "/ckpt"])
def test_a_checkpoint_folder_behind_a_dangling_link_is_refused_as_one(tmp_path, below):
    """A link to a folder not made yet (or unmounted) was called "a file, not a folder"."""
    from orchestrator.planning.placement import folder_problem

    link = tmp_path / "ckpt-link"
    link.symlink_to(tmp_path / "scratch" / "run1")
    problem = folder_problem(str(link) + below)
    assert problem is not None and f"a link to {tmp_path / 'scratch' / 'run1'}, which does not exist" in problem
    assert "a file" not in problem and "To fix: make that folder" in problem
