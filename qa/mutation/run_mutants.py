#!/usr/bin/env python3
"""Mutation testing of the activation-recompute, stash, delayed-scaling update and
non-finite-amax logic: how many small wrong versions of that code the tests catch.

Each mutant is one textual change of one source line (a condition dropped or
inverted, a call removed, a value swapped). The script copies the repository (the
files git tracks, plus untracked ones it does not ignore) into a temporary folder
once, then for each mutant patches the copy, runs the test files that guard that
code (``pytest -x``, with a time limit), and puts the file back. A mutant is
*killed* when the tests fail (or time out), *survives* when they pass. The score is
killed / non-equivalent mutants; an equivalent mutant (one no run can tell apart from
the original) says why in its ``equivalent`` field. Your working tree is never
touched.

Not part of CI: on two shared cores a full run takes tens of minutes. From the
repository root::

    python3 qa/mutation/run_mutants.py                    # all mutants, table + score
    python3 qa/mutation/run_mutants.py --only M07 M12     # some of them
    python3 qa/mutation/run_mutants.py --list             # what each mutant changes

The exit status is 0 when the score reaches ``--target`` (default 95%), no mutant
failed to apply (its line changed: update it), and the unmutated baseline passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
PT = "transformer_engine/pytorch/"
T = "tests/pytorch/"

# Test files, most targeted first (pytest -x stops at the first failure).
HOOKS = T + "test_recompute_hooks.py"
INV = T + "test_recompute_invariance.py"
ACT = T + "test_fp8_activation_recompute.py"
ROB = T + "test_checkpoint_robustness.py"
REPLAY = T + "test_checkpoint_replay.py"
EDGES = T + "test_recompute_edges.py"
CACHE = T + "test_weight_cache.py"
NONFIN = T + "test_non_finite_amax.py"
BWD = T + "test_backward_update.py"
API = T + "test_checkpoint_api.py"
SAVED = T + "test_checkpoint_saved_tensors.py"
INNER = T + "test_recompute_inner_backward.py"
CORE = (HOOKS, INV, ACT)


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str                  # relative to the repository root
    old: str                   # must occur exactly once in the file
    new: str
    what: str                  # the behaviour the mutant breaks
    tests: Tuple[str, ...] = CORE
    equivalent: Optional[str] = None     # why no run can tell it from the original


MUTANTS = [
    # ---- recompute.py: where a thread stands, frames, stashes ---------------------------
    Mutant("M01", PT + "recompute.py",
           "region=True, phase=saved.phase or recomputing,",
           "region=True, phase=recomputing,",
           "a checkpoint nested in a recompute drops the recompute-phase flag",
           (ROB, ACT, INV)),
    Mutant("M02", PT + "recompute.py",
           "        if recomputing:\n            break\n",
           "        if recomputing:\n            continue\n",
           "frames older than the recomputing one keep recording (an inner recompute's take "
           "lands in the enclosing phase-1 frame)",
           (INV, ROB, ACT)),
    Mutant("M03", PT + "recompute.py",
           "    entry = source.take(fp8_meta)\n    for frame in _recording(frames):\n"
           "        frame.add(fp8_meta, entry)\n",
           "    entry = source.take(fp8_meta)\n",
           "a checkpoint nested in a recompute records none of the stashes handed out",
           (ROB, ACT, INV)),
    Mutant("M04", PT + "recompute.py",
           "self.cursor[key] = position_ + 1",
           "self.cursor[key] = position_",
           "every recompute call of a module takes its first stash",
           CORE),
    Mutant("M05", PT + "recompute.py",
           "            self._fold_compiled()\n        self.cursor = {}\n",
           "            self._fold_compiled()\n",
           "a second recompute of the same call (retain_graph) starts where the first ended",
           (REPLAY, HOOKS, INV)),
    Mutant("M06", PT + "recompute.py",
           "if len(frames) == 1 and not frames[0][1]:      # one phase-1 frame",
           "if len(frames) == 1:      # one phase-1 frame",
           "the stash fast path also takes a single recomputing frame",
           CORE,
           equivalent="stash() is reached only from the copy hook, which this package's modules "
                      "call only outside the recompute phase; with one frame on the stack that "
                      "frame is then a recording one, so the changed condition never decides "
                      "anything"),
    Mutant("M07", PT + "recompute.py",
           "return torch.is_grad_enabled() or _THREAD.position.training_under_no_grad",
           "return torch.is_grad_enabled()",
           "a client checkpoint's no_grad first forward (activation_recompute_forward) no "
           "longer counts as training",
           (API, HOOKS, INV)),
    Mutant("M08", PT + "recompute.py",
           "                self.replaced_modes[key] = (module, module.training)\n"
           "                module.training = training\n",
           "                self.replaced_modes[key] = (module, module.training)\n",
           "the recompute runs modules in their current train/eval mode, not phase 1's",
           (ROB, REPLAY)),
    Mutant("M09", PT + "recompute.py",
           "if id(module) not in self.modes:",
           "if True:",
           "a module's recorded mode is that of its last phase-1 call, not its first",
           (ROB, REPLAY, INV)),

    # ---- checkpoint_modes.py: the two checkpoint implementations -----------------------------
    Mutant("M10", PT + "checkpoint_modes.py",
           "torch.set_grad_enabled(call.training):",
           "torch.set_grad_enabled(False):",
           "the reentrant phase 1 runs under no_grad: nothing inside counts as training",
           CORE),
    Mutant("M11", PT + "checkpoint_modes.py",
           "training_under_no_grad=False if reentrant else None):",
           "training_under_no_grad=self.training if reentrant else None):",
           "the reentrant phase 1 counts a no_grad branch inside the function as training",
           CORE),
    Mutant("M12", PT + "checkpoint_modes.py",
           "return a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a",
           "return a.detach() if torch.is_tensor(a) else a",
           "the reentrant phase 1 sees its arguments as not requiring grad",
           CORE),
    Mutant("M13", PT + "checkpoint_modes.py",
           "        leaves = [t.detach() if torch.is_tensor(t) else t for t in leaves]\n",
           "",
           "the reentrant phase 1 returns outputs still attached to its own graph",
           (SAVED, INV, ACT, HOOKS)),
    Mutant("M14", PT + "checkpoint_modes.py",
           "with collect_backward_updates():",
           "with contextlib.nullcontext():",
           "the reentrant recompute's backward updates run at the end of its inner pass, "
           "before the enclosing pass is done",
           CORE + (BWD, INNER)),
    Mutant("M15", PT + "checkpoint_modes.py",
           "            FP8GlobalStateManager.set_fp8_autocast_state(self.fp8_state)\n"
           "            try:\n",
           "            try:\n",
           "the recompute runs without the call site's FP8 autocast",
           CORE),
    Mutant("M16", PT + "checkpoint_modes.py",
           "                self.frame.replay_modes()\n                with self.user_recompute_ctx:",
           "                with self.user_recompute_ctx:",
           "the recompute does not give modules their phase-1 train/eval mode",
           (ROB, REPLAY)),

    # ---- fp8.py: the recompute hooks and the autocast exit ------------------------------------
    Mutant("M17", PT + "fp8.py",
           "        training = cls.is_fp8_enabled() and recompute.is_training_forward()\n",
           "        training = False\n",
           "the stash carries no autocast session: the recompute's backward asks for no "
           "backward update",
           CORE),
    Mutant("M18", PT + "fp8.py",
           "        training = cls.is_fp8_enabled() and recompute.is_training_forward()\n",
           "        training = cls.is_fp8_enabled()\n",
           "a module that is no training forward stashes the session too",
           CORE,
           equivalent="the session of a stash is used only by the backward of the recomputed "
                       "call; a call that is no training forward (grad disabled where it ran) "
                       "has no backward, in either phase"),
    Mutant("M19", PT + "fp8.py",
           "            fp8_meta[RECOMPUTE_STASH_KEY] = entry\n\n",
           "\n",
           "phase 1 hands the module no stash: the FP8 weights it used are not kept for the "
           "recompute",
           (CACHE, HOOKS, INV)),
    Mutant("M20", PT + "fp8.py",
           "        fp8_meta[\"scaling_fwd\"] = entry.snapshot.state\n",
           "",
           "the recompute casts with the live (updated) forward state",
           CORE),
    Mutant("M21", PT + "fp8.py",
           "            fp8_meta[\"scaling_fwd\"] = fp8_meta.pop(\"updated_fp8_state_fwd\")",
           "            fp8_meta.pop(\"updated_fp8_state_fwd\")",
           "the live forward state is not put back after the recompute's forward",
           CORE),
    Mutant("M22", PT + "fp8.py",
           "        fp8_meta.pop(RECOMPUTE_STASH_KEY, None)\n        if \"updated_fp8_state_fwd\"",
           "        if \"updated_fp8_state_fwd\"",
           "the stash of a recomputed call stays in fp8_meta after it",
           CORE),
    Mutant("M23", PT + "fp8.py",
           "    return recipe is not None and recipe.delayed() and fp8_meta.get(\"scaling_fwd\")",
           "    return recipe is not None and fp8_meta.get(\"scaling_fwd\")",
           "the hooks stash and swap for a module on a recipe without delayed scaling",
           CORE),
    Mutant("M24", PT + "fp8.py",
           "        if outermost and not recompute.in_phase():",
           "        if outermost:",
           "an autocast exiting inside a recompute runs the forward update",
           CORE),
    Mutant("M25", PT + "fp8.py",
           "if outermost and session is not None and not recompute.in_phase():",
           "if outermost and session is not None:",
           "an exception in a recompute drops the live amaxes of the recompute's session",
           CORE + (EDGES,),
           equivalent="a recompute registers no module with its session (it records nothing), "
                      "so the session whose amaxes would be dropped holds no module"),

    # ---- module/base.py: the forward prologue ------------------------------------------------
    Mutant("M26", PT + "module/base.py",
           "            if fp8 and plan.delayed:\n                # the hooks return nothing",
           "            if plan.delayed:\n                # the hooks return nothing",
           "a calibrating (not FP8) recompute looks for a stash",
           CORE + (EDGES,)),
    Mutant("M27", PT + "module/base.py",
           "plan.session, plan.stash = entry.session, entry",
           "plan.stash = entry",
           "the recompute's backward asks for no backward update",
           CORE),
    Mutant("M28", PT + "module/base.py",
           "            if recompute.is_training_forward():\n                plan.record_amax = True",
           "            if True:\n                plan.record_amax = True",
           "every forward records amaxes and registers for the update, under no_grad too",
           CORE),
    Mutant("M29", PT + "module/base.py",
           "                plan.session, plan.stash = entry.session, entry\n",
           "                plan.session, plan.stash = entry.session, entry\n"
           "                plan.record_amax = True\n",
           "the recompute records amaxes (into the state its stash reads)",
           CORE),
    Mutant("M30", PT + "module/base.py",
           "plan.stash = self.fp8_meta.pop(RECOMPUTE_STASH_KEY, None)",
           "plan.stash = self.fp8_meta.get(RECOMPUTE_STASH_KEY)",
           "phase 1 leaves its stash in fp8_meta",
           CORE),
    Mutant("M31", PT + "module/forward_plan.py",
           "            FP8GlobalStateManager.restore_fp8_meta_tensors(self.swapped_meta)",
           "            pass",
           "the recompute's forward does not put the live state back",
           CORE),
    Mutant("M32", PT + "distributed.py",
           "return recompute.in_region() and FP8GlobalStateManager.is_fp8_enabled()",
           "return recompute.in_region()",
           "the recompute region counts as FP8 recompute without an enabled autocast",
           CORE + (EDGES,)),

    Mutant("M44", PT + "module/fp8_linear.py",
           "        if plan.session is not None:\n            if not plan.replaying():\n",
           "        if plan.session is not None and need_wgrad:\n"
           "            if not plan.replaying():\n",
           "a layer with frozen weights asks for no backward update",
           (INV, BWD)),

    # ---- module/fp8_operands.py, block_scaling.py: casts in a recompute ----------------------
    Mutant("M33", PT + "module/fp8_operands.py",
           "    count = not plan.recomputing\n",
           "    count = True\n",
           "the recompute's current/block-scaling casts count non-finite amaxes again",
           CORE),
    Mutant("M34", PT + "block_scaling.py",
           "if count_non_finite and amaxes is not None and amaxes.numel() > 0:",
           "if amaxes is not None and amaxes.numel() > 0:",
           "block-scaled casts of a recompute count non-finite amaxes again",
           CORE),
    Mutant("M35", PT + "module/fp8_operands.py",
           "    if not plan.recomputing:\n        cache[gemm] = found\n",
           "    if True:\n        cache[gemm] = found\n",
           "the recompute writes the FP8 weight cache",
           (INV, CACHE)),
    Mutant("M36", PT + "module/fp8_operands.py",
           "if plan.recomputing and plan.stash is not None and gemm in plan.stash.weights:",
           "if False:",
           "the recompute reads the weight cache instead of the FP8 weights its phase 1 used",
           (CACHE, INV)),

    # ---- amax_update.py, scaling.py: the update and the snapshots ----------------------------
    Mutant("M37", PT + "amax_update.py",
           "        copy_before_write(states)\n    if recipe.reduce_amax",
           "        pass\n    if recipe.reduce_amax",
           "the update writes into states that recompute snapshots still read",
           CORE),
    Mutant("M38", PT + "amax_update.py",
           "        stack[-1].setdefault(id(session), session)\n        return\n",
           "        return\n",
           "backward updates asked for in a reentrant recompute's inner pass are lost",
           CORE + (BWD,)),
    Mutant("M39", PT + "amax_update.py",
           "        update_sessions(list(sessions.values()), forward=False)",
           "        update_sessions(list(sessions.values()), forward=True)",
           "the end of a backward pass updates the forward states",
           CORE + (BWD,)),
    Mutant("M40", PT + "amax_update.py",
           "    if session.requested_in == task:        # graph task ids are never reused\n"
           "        return\n",
           "",
           "a second ask in the same pass goes through the lock again",
           CORE + (BWD,),
           equivalent="the session is already in the pass's pending set, so setdefault changes "
                      "nothing and no second callback is queued (only host time differs)"),
    Mutant("M41", PT + "amax_update.py",
           "            update_states(list(g.metas.values()), g.recipe, g.group, forward)\n"
           "        NON_FINITE.warn_once_if_seen()\n        return\n",
           "            update_states(list(g.metas.values()), g.recipe, g.group, forward)\n"
           "        return\n",
           "an update no longer warns about non-finite amaxes",
           (INV, NONFIN)),
    Mutant("M42", PT + "scaling.py",
           "            s.pending = None\n",
           "",
           "snapshots taken after an update share the copy made for older ones",
           CORE + (REPLAY,)),
    Mutant("M43", PT + "distributed.py",
           "with recompute.enter(frame, recomputing=False, training_under_no_grad=True):",
           "with recompute.enter(frame, recomputing=False, training_under_no_grad=False):",
           "a client checkpoint's first forward (under no_grad) records no amax",
           (API, HOOKS)),

    # ---- a backward inside the checkpointed function (NOTE [Backward inside a ...]) ------
    Mutant("M45", PT + "recompute.py",
           "    if recomputing:\n        flags.replaying = True\n",
           "    if recomputing:\n        pass\n",
           "a recompute is never seen as running: its inner backward records and updates again",
           (INNER, INV)),
    Mutant("M46", PT + "recompute.py",
           "        flags.recording = True\n        _acquire_mode_hook()",
           "        _acquire_mode_hook()",
           "a phase-1 inner backward keeps no backward state for the recompute to cast with",
           (INNER, INV)),
    Mutant("M47", PT + "recompute.py",
           "    for frame, recomputing in _THREAD.position.frames:\n        if recomputing:\n"
           "            return frame.flags",
           "    for frame, recomputing in reversed(_THREAD.position.frames):\n"
           "        if recomputing:\n            return frame.flags",
           "a call made in a recompute nested in another is replayed only while the inner one runs",
           (INNER, INV)),
    Mutant("M48", PT + "fp8.py",
           "                               recompute.recording_flags(), {})",
           "                               (), {})",
           "a stash names no phase-1 run, so no inner backward keeps its backward state",
           (INNER, INV)),
    Mutant("M49", PT + "module/base.py",
           "            plan.replay = recompute.replay_flags()\n",
           "",
           "a recomputed call never knows its backward is part of the recompute",
           (INNER, INV)),
    Mutant("M50", PT + "module/forward_plan.py",
           "        return self.replay is not None and self.replay.replaying\n",
           "        return self.replay is not None\n",
           "the backward after a reentrant recompute is taken for a replayed one",
           (INNER, INV)),
    Mutant("M51", PT + "module/forward_plan.py",
           "        return kept[done].state, False\n",
           "        return live, False\n",
           "a replayed inner backward casts with the live backward scale, not phase 1's",
           (INNER, INV)),
    Mutant("M52", PT + "module/forward_plan.py",
           "        taken[slot] = done + 1\n",
           "        taken[slot] = done\n",
           "a second inner backward through a call replays the first one's backward state",
           (INNER, INV)),
    Mutant("M53", PT + "module/forward_plan.py",
           "and any(flags.recording for flags in stash.owners)):",
           "and stash.owners):",
           "every backward of a stashed call keeps a backward state, also after phase 1",
           (INNER, INV)),
    Mutant("M54", PT + "module/fp8_linear.py",
           "dy_fp8, dy_t = cast_operand(dy, plan, state, i, fmt.dtype_bwd, record,",
           "dy_fp8, dy_t = cast_operand(dy, plan, state, i, fmt.dtype_bwd, True,",
           "a replayed inner backward records its gradient amax again",
           (INNER, INV),
           equivalent="the replay casts with a snapshot whose state the update asked for by "
                      "phase 1's inner backward has already copied, so the amax goes into a "
                      "copy that nothing reads (only its scale is)"),
    Mutant("M55", PT + "module/fp8_linear.py",
           "transpose=need_wgrad, count=record)",
           "transpose=need_wgrad)",
           "backward casts count non-finite amaxes as forward ones: replays count, reentrant "
           "backwards of recomputed calls do not",
           (INNER, NONFIN)),
    Mutant("M60", PT + "module/fp8_linear.py",
           "transpose=need_wgrad, count=record)",
           "transpose=need_wgrad, count=True)",
           "a replayed inner backward counts its non-finite amaxes again (current, block)",
           (INNER, NONFIN)),
    Mutant("M56", PT + "module/fp8_linear.py",
           "            if not plan.replaying():\n                request_backward_update",
           "            if True:\n                request_backward_update",
           "a replayed inner backward asks for a backward update again",
           (INNER, INV)),
    Mutant("M57", PT + "checkpoint_modes.py",
           "    state.held = {}\n",
           "",
           "a non-reentrant phase 1 keeps nothing for a backward inside the function",
           (INNER, SAVED)),
    Mutant("M58", PT + "checkpoint_modes.py",
           "            return self.held[position]\n",
           "            return self.held.pop(position)\n",
           "a phase-1 saved tensor serves one inner backward only",
           (INNER, SAVED)),
    Mutant("M59", PT + "checkpoint_modes.py",
           "            return recomputed[position]\n",
           "            return recomputed.pop(position)\n",
           "an inner backward in the recompute takes the tensors the outer backward needs",
           (INNER, SAVED)),
]


def _copy_repository(dest: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in listed:
        if not name:
            continue
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _run_tests(copy: Path, tests, python: str, timeout: float) -> Tuple[str, float, str]:
    """``(outcome, seconds, first failing test)``; outcome "pass", "fail" or "timeout"."""
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    if done.returncode == 0:
        return "pass", seconds, ""
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    where = found.group(1) if found else f"pytest exit {done.returncode}"
    if done.returncode == 5:
        raise RuntimeError(f"no tests collected by {' '.join(tests)}")
    return "fail", seconds, where


def _line_of(text: str, snippet: str) -> int:
    return text[:text.index(snippet)].count("\n") + 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch/pytest")
    parser.add_argument("--target", type=float, default=95.0, help="score to reach, in %%")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the unmutated tests first")
    parser.add_argument("--tests", nargs="+",
                        help="run these pytest arguments for every chosen mutant instead of its "
                             "own selection (to check that one test kills a mutant)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate mutant ids")
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            mark = " (equivalent)" if m.equivalent else ""
            print(f"{m.id} {m.path}: {m.what}{mark}\n    - {m.old.strip()}\n    + {m.new.strip()}")
        return 0

    with tempfile.TemporaryDirectory(prefix="te-mutants-") as tmp:
        copy = Path(tmp)
        _copy_repository(copy)
        if not args.skip_baseline:
            selections = sorted({m.tests for m in chosen})
            files = sorted({f for s in selections for f in s})
            outcome, seconds, where = _run_tests(copy, files, args.python, 4 * args.timeout)
            print(f"baseline ({len(files)} files): {outcome} in {seconds:.0f}s {where}", flush=True)
            if outcome != "pass":
                return 1
        rows, stale = [], []
        for m in chosen:
            path = copy / m.path
            original = path.read_text()
            if original.count(m.old) != 1:
                stale.append(m.id)
                rows.append((m, "?", "STALE", 0.0, f"snippet found {original.count(m.old)}x"))
                continue
            line = _line_of(original, m.old)
            try:
                path.write_text(original.replace(m.old, m.new))
                outcome, seconds, where = _run_tests(copy, m.tests, args.python, args.timeout)
            finally:
                path.write_text(original)
            status = {"fail": "killed", "timeout": "killed (timeout)", "pass": "SURVIVED"}[outcome]
            rows.append((m, line, status, seconds, where))
            print(f"{m.id} {m.path}:{line} {status} {seconds:.0f}s {where}", flush=True)

    print()
    print(f"{'id':4} {'where':38} {'outcome':17} {'s':>5}  behaviour broken / killed by")
    for m, line, status, seconds, where in rows:
        shown = status + (" (equiv.)" if m.equivalent else "")
        print(f"{m.id:4} {m.path.replace(PT, '') + ':' + str(line):38} {shown:17} "
              f"{seconds:5.0f}  {m.what}")
        if where:
            print(f"{'':66}{where}")
    counted = [(m, s) for m, _, s, _, _ in rows if not m.equivalent and s != "STALE"]
    killed = sum(s.startswith("killed") for _, s in counted)
    equivalent = [m for m, *_ in rows if m.equivalent]
    killed_equivalent = [m.id for m, _, s, _, _ in rows if m.equivalent and s.startswith("killed")]
    score = 100.0 * killed / len(counted) if counted else 100.0
    print(f"\nscore: {killed}/{len(counted)} non-equivalent mutants killed = {score:.1f}% "
          f"(target {args.target:.0f}%); {len(equivalent)} equivalent, run for information")
    for m, _, s, _, _ in rows:
        if not m.equivalent and s == "SURVIVED":
            print(f"survivor {m.id}: {m.what}")
    for m in equivalent:
        print(f"equivalent {m.id}: {m.equivalent}")
    if killed_equivalent:
        print(f"killed although marked equivalent (not equivalent after all): {killed_equivalent}")
    if stale:
        print(f"stale mutants (their line changed; update them): {stale}")
    return 0 if score >= args.target and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
