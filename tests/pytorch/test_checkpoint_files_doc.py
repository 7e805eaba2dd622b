"""docs/checkpoint-files.md runs as printed: its one-process DCP resume (in this
process, then its weights-only planner refuses a checkpoint whose bytes entry holds
an object outside torch.load's weights-only set), and its FSDP2 script under
torchrun on 2 CPU processes."""

import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "checkpoint-files.md"


class NotAPayload:
    """An object no weights-only allow-list holds."""


def _blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_doc_has_the_two_runnable_blocks():
    blocks = _blocks()
    assert len(blocks) == 2 and blocks[1].startswith("# fsdp2_resume.py")


def test_one_process_resume_runs_and_its_planner_refuses_other_objects(tmp_path):
    import torch.distributed.checkpoint as dcp
    namespace = {"__name__": "checkpoint_files_doc"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        exec(compile(_blocks()[0], str(DOC), "exec"), namespace)
        # a checkpoint whose entry for the payload is an arbitrary object: refused (a
        # class of this file: argparse.Namespace, say, is one Megatron Core adds to
        # torch's weights-only allow-list when it is imported)
        hostile = {"0._extra_state": NotAPayload()}
        dcp.save(hostile, checkpoint_id=tmp_path)
        state = {"0._extra_state": torch.zeros(0, dtype=torch.uint8)}
        with pytest.raises(dcp.CheckpointException, match="Weights only load failed"):
            dcp.load(state, checkpoint_id=tmp_path, planner=namespace["WeightsOnlyLoadPlanner"]())
    assert type(state["0._extra_state"]) is torch.Tensor


def test_fsdp2_script_runs_under_torchrun(tmp_path):
    script = tmp_path / "fsdp2_resume.py"
    script.write_text(_blocks()[1])
    # PYTHONFAULTHANDLER: a rank that dies in C++ still prints where Python was
    env = dict(os.environ, CHECKPOINT_DIR=str(tmp_path / "checkpoint"), PYTHONFAULTHANDLER="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
