"""Extraction on a local Ray (two actors, 40 documents): every id once, records equal to the
single-process ones, a failing document as an error row, and kill-and-resume that loses and
duplicates nothing."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
import ray.data  # noqa: E402

from constrained_spec.bench.batch import Person, load_documents  # noqa: E402
from constrained_spec.pipelines.extract import extract  # noqa: E402
from constrained_spec.ray import COLUMNS, extract_dataset, extract_to  # noqa: E402

pytestmark = pytest.mark.slow
SCHEMA = Person.model_json_schema()
TOO_LONG = {"id": "too-long", "text": "word " * 9000}  # over the model's context: an error row


def _docs() -> list[dict]:
    docs = [{"id": d["id"], "text": d["text"]} for d in load_documents(limit=39)]
    return docs[:20] + [TOO_LONG] + docs[20:]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(smol):
    """The single-process records, by id."""
    return {r.id: r.to_record() for r in extract(SCHEMA, [(d["id"], d["text"]) for d in _docs()], model=smol,
                                                 batch_size=16, max_new_tokens=64)}


def test_two_actors_every_id_once_and_records_equal_single_process(local_ray, reference):
    ds = ray.data.from_items(_docs())
    rows = extract_dataset(ds, SCHEMA, batch_size=8, concurrency=2, num_cpus=1, max_new_tokens=64).take_all()
    assert sorted(rows[0]) == sorted(COLUMNS)
    ids = [r["id"] for r in rows]
    assert len(ids) == 40 and set(ids) == {d["id"] for d in _docs()}
    for r in rows:
        want = reference[r["id"]]
        if "error" in want:
            assert r["value"] is None and r["error_kind"] == want["error"]["kind"]
        else:
            assert r["error_kind"] is None and json.loads(r["value"]) == want["value"], r["id"]
    bad = next(r for r in rows if r["id"] == "too-long")
    assert bad["error_kind"] == "InvalidPromptError" and "context" in bad["error_message"]


def test_bad_options_and_columns_fail_on_the_driver(local_ray):
    from constrained_spec.errors import InvalidOptionError

    ds = ray.data.from_items([{"id": "a", "body": "text"}])
    with pytest.raises(InvalidOptionError, match="'text'"):
        extract_dataset(ds, SCHEMA)
    with pytest.raises(InvalidOptionError, match="temprature"):
        extract_dataset(ray.data.from_items(_docs()[:1]), SCHEMA, temprature=0.5)


def _written_ids(folder: Path) -> list[str]:
    ids = []
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            ids += [json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()]
    return ids


def _a_complete_line_in(folder: Path) -> bool:
    if not folder.exists():
        return False
    for f in folder.iterdir():
        try:
            if f.is_file() and not f.name.startswith(".") and b"\n" in f.read_bytes():
                return True
        except FileNotFoundError:  # renamed or removed while we looked
            continue
    return False


def test_killed_job_resumes_with_every_id_once(local_ray, tmp_path):
    """A driver joined to the running cluster is killed once some results are written; the
    resumed run writes only the rest: 40 ids, each exactly once."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    docs = _docs()
    for i in range(8):  # several input files: blocks finish and are written one by one
        (inputs / f"part-{i}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[i * 5:(i + 1) * 5]))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "constrained_spec.cli", "extract", "--engine", "ray", "--address", local_ray,
           "--schema", json.dumps(SCHEMA), "--input", str(inputs), "--output", str(out), "--output-format", "jsonl",
           "--batch-size", "5", "--concurrency", "1", "--num-cpus", "1", "--max-new-tokens", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if _a_complete_line_in(out):  # a file can exist before its first row is flushed
            break
        time.sleep(0.2)
    killed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(list(out.iterdir())) if out.exists() else 0
    assert killed and first > 0
    counts = extract_to(inputs, out, SCHEMA, fmt="jsonl", resume=True, batch_size=5, concurrency=1, num_cpus=1,
                        max_new_tokens=64)
    ids = _written_ids(out)
    assert 0 < counts["skipped"] < 40 and counts["documents"] == 40
    assert collections.Counter(ids) == collections.Counter({d["id"]: 1 for d in docs})
    assert os.listdir(out)


def test_resume_keeps_the_whole_lines_of_a_cut_file_and_drops_unreadable_ones(tmp_path):
    """What a kill leaves in a JSONL output folder: a file cut mid-line keeps its whole rows (the
    partial one is cut off, so appending stays valid), an empty file and a file with a broken
    whole line are removed, and their documents are done again."""
    from constrained_spec.pipelines.distributed import done_ids

    (tmp_path / "cut.json").write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "va')
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "broken.json").write_bytes(b'{"id": "d"}\n{"id": \n')
    (tmp_path / "whole.json").write_bytes(b'{"id": 7}\n')
    assert done_ids(tmp_path, "jsonl") == {"a", "b", "7"}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["cut.json", "whole.json"]
    assert (tmp_path / "cut.json").read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
