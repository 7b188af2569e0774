"""The job's code archive (orchestrator/control/codesync.py): what goes in, that the same tree always gives the
same bytes, and the size cap's one-line error, also at `tfsn validate` / `tfsn launch` of a cloud job."""
from __future__ import annotations

import io
import os
import shutil
import tarfile

import pytest
import yaml

from orchestrator.control.codesync import CodeSyncError, check_size, pack


def tree(root, files: dict[str, str | bytes]):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def packed(workdir, **kw) -> tuple[str, dict[str, tarfile.TarInfo]]:
    out = io.BytesIO()
    digest = pack(workdir, out, **kw)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue()), mode="r:gz") as archive:
        return digest, {m.name: m for m in archive.getmembers()}


def test_the_same_tree_gives_the_same_archive_wherever_and_whenever_it_was_written(tmp_path):
    files = {"train.py": "print(1)\n", "lib/model.py": "x = 1\n", "run.sh": "#!/bin/sh\n"}
    first = tree(tmp_path / "a", files)
    (first / "run.sh").chmod(0o755)
    digest, members = packed(first)
    second = tmp_path / "elsewhere" / "b"
    shutil.copytree(first, second)
    for path in second.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    os.chmod(second / "train.py", 0o600)   # a umask differs: only the exec bit is kept
    assert packed(second)[0] == digest
    assert {m.mtime for m in members.values()} == {0} and {m.uname for m in members.values()} == {""}
    assert members["run.sh"].mode == 0o755 and members["train.py"].mode == 0o644
    (second / "train.py").write_text("print(2)\n")
    assert packed(second)[0] != digest


def test_the_plans_search_entries_go_in_under_the_reserved_folder_and_a_node_installs_only_entries(tmp_path,
                                                                                                    monkeypatch):
    """The controller's side (the job's plan packed with its code) and the node's (its agent's install into the
    workers' cache, which starts empty there): a name that is not an entry's, or an entry the node has, is kept out."""
    from optimizer.cache import PLAN_FOLDER, install_search_entries, search_dir
    workdir = tree(tmp_path / "code", {"train.py": "print(1)\n", f"{PLAN_FOLDER}/{'0' * 64}.json": "the user's"})
    names = [f"{c * 64}.json" for c in "ab"]
    cache = tree(tmp_path / "controller-cache", {f"search/{n}": f'{{"entry": "{n[0]}"}}' for n in names})
    entries = [cache / "search" / n for n in names]
    digest, members = packed(workdir, plan=[*entries, cache / "search" / f"{'c' * 64}.json"])   # c: gone since
    assert sorted(members) == [PLAN_FOLDER, *(f"{PLAN_FOLDER}/{n}" for n in names), "train.py"]
    assert packed(workdir, plan=entries[::-1])[0] == digest != packed(workdir)[0]

    node = tmp_path / "node"
    out = io.BytesIO()
    pack(workdir, out, plan=entries)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue()), mode="r:gz") as archive:
        archive.extractall(node, filter="data")
    (node / PLAN_FOLDER / "not-an-entry.json").write_text("{}")
    monkeypatch.setenv("TFSN_CACHE", str(tmp_path / "node-cache"))
    tree(search_dir(), {names[1]: "the node's own"})
    assert install_search_entries(node / PLAN_FOLDER) == 1
    assert sorted(p.name for p in search_dir().iterdir()) == names
    assert (search_dir() / names[0]).read_text() == '{"entry": "a"}'
    assert (search_dir() / names[1]).read_text() == "the node's own"


def test_gitignore_rules_decide_what_goes_in(tmp_path):
    workdir = tree(tmp_path, {
        ".gitignore": "# data and outputs\ndata/\n*.pt\n!keep.pt\n/out\nlogs/**/*.log\n",
        "train.py": "", "keep.pt": "", "model.pt": "", "sub/model.pt": "", "data/x.csv": "", "sub/data/y.csv": "",
        "out/a": "", "sub/out/b": "", "logs/a/b/c.log": "", "logs/a/b/c.txt": "", "data.py": "",
        "sub/.gitignore": "local.txt\n", "sub/local.txt": "", "local.txt": "", ".git/HEAD": "ref\n"})
    names = set(packed(workdir)[1])
    assert {"train.py", "keep.pt", "sub/out/b", "logs/a/b/c.txt", "data.py", "local.txt", ".gitignore"} <= names
    assert not names & {"model.pt", "sub/model.pt", "data/x.csv", "sub/data/y.csv", "out/a", "logs/a/b/c.log",
                        "sub/local.txt", ".git", ".git/HEAD"}


def test_a_tfsnignore_replaces_the_gitignore(tmp_path):
    workdir = tree(tmp_path, {".gitignore": "data/\n", ".tfsnignore": "*.ckpt\n", "data/x.csv": "", "a.ckpt": "",
                              "train.py": ""})
    names = set(packed(workdir)[1])
    assert "data/x.csv" in names and "a.ckpt" not in names and "train.py" in names


def test_a_workdir_over_the_cap_is_refused_with_one_line_that_says_how_to_fix_it(tmp_path, monkeypatch):
    workdir = tree(tmp_path / "job", {"train.py": "x", "data/shard.bin": b"0" * 3 * 2**20})
    with pytest.raises(CodeSyncError) as refused:
        packed(workdir, limit=2**20)
    message = str(refused.value)
    assert "\n" not in message and "3.0 MiB" in message and "cap of 1.0 MiB" in message
    assert "data/ (3.0 MiB)" in message and str(workdir / ".gitignore") in message and "TFSN_CODE_MAX_MB" in message
    (workdir / ".gitignore").write_text("data/\n")   # the fix it names works
    assert check_size(workdir, limit=2**20) == len("x") + len("data/\n")
    monkeypatch.setenv("TFSN_CODE_MAX_MB", "lots")
    with pytest.raises(CodeSyncError, match="TFSN_CODE_MAX_MB='lots' is not a number"):
        check_size(workdir)


def test_validate_and_launch_refuse_a_cloud_jobs_workdir_over_the_cap(tfsn, tmp_path):
    workdir = tree(tmp_path / "job", {"train.py": "x", "weights.bin": b"0" * 2 * 2**20})
    spec = tmp_path / "train.yaml"
    spec.write_text(yaml.safe_dump({"name": "big", "run": "python train.py", "workdir": str(workdir),
                                    "resources": {"infra": ["aws"], "accelerators": "A100:8"},
                                    "checkpoint": {"dir": "s3://bucket/big"}}))
    tfsn.env["TFSN_CODE_MAX_MB"] = "1"
    for command in ("validate", "launch"):
        proc = tfsn(command, str(spec), check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and "workdir" in proc.stderr and "2.0 MiB" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    tfsn.env["TFSN_CODE_MAX_MB"] = "4"
    assert tfsn("validate", str(spec)).returncode == 0
