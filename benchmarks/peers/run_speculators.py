"""speculators 0.9.0 EAGLE-3 on the prepared data (OUT/plan.json), on the CPU, in its own venv:
``speculators train`` through ``shims/speculators_cpu.py``, its log in RUN/train.log, checkpoints in
RUN/checkpoints/<epoch>/ (the last one is what done.json names).

    ~/.cache/headway/peers/speculators/bin/python benchmarks/peers/run_speculators.py [OUT] \\
        [--defaults own|shared] [--run-dir DIR] [--set lr=0.002 --set seed=1 --set max_steps=3 ...]

Every mode passes the data (the rows, the draft vocabulary's ids, a train ratio that keeps every row for
training: its loader insists on a validation split), the aux layers, and what a CPU needs:
``--loss-implementation eager`` (the fused loss is Triton), ``--draft-attn-impl sdpa`` (flex attention
wants a GPU), ``--num-workers 0`` and ``--on-missing raise`` (no vLLM server makes missing states).
The mode's options (defaults.py) follow as ``--name value``.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner  # noqa: E402


def flags(options: dict[str, Any]) -> list[str]:
    """{name: value} -> speculators train's flags (``--no-x`` for a false bool, lists spread)."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def command(run: runner.Run) -> list[str]:
    me = run.me
    return [sys.executable, str(HERE / "shims" / "speculators_cpu.py"), "train",
            "--speculator-type", "eagle3", "--verifier-name-or-path", run.plan["target"],
            "--data-path", me["data"], "--d2t-path", run.vocab("d2t"), "--t2d-path", run.vocab("t2d"),
            "--draft-vocab-size", str(run.settings["draft_vocab_size"]),
            "--target-layer-ids", *map(str, me["aux_ids"]), "--train-data-ratio", str(me["train_data_ratio"]),
            "--on-missing", "raise", "--save-path", str(run.run_dir / "checkpoints"),
            "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0",
            *flags(run.options)]


def last_checkpoint(folder: Path) -> Path:
    epochs = sorted((int(p.name) for p in folder.iterdir() if p.name.isdigit() and not p.is_symlink()), reverse=True)
    if not epochs:
        raise SystemExit(f"run_speculators.py: error: no checkpoint under {folder}")
    return folder / str(epochs[0])


def main() -> None:
    args = runner.parser("speculators", __doc__).parse_args()
    run = runner.start("speculators", args)
    if run is None:
        return
    cmd = command(run)
    with open(run.run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # to the terminal and the log, as tee would
            sys.stdout.write(line)
            log.write(line)
    if proc.wait() != 0:
        raise SystemExit(f"run_speculators.py: error: speculators train exited {proc.returncode} "
                         f"(log: {run.run_dir / 'train.log'})")
    runner.finish(run, last_checkpoint(run.run_dir / "checkpoints"), command=cmd[1:])


if __name__ == "__main__":
    main()
