"""Run by tests/test_torchrun.py under torchrun: train test_train's tiny MLP with harmony_opt.train.

``python torchrun_train.py MODE GPUS STEPS OUT [CHECKPOINT_DIR [resume]]``; rank 0 saves its
TrainResult's weights, losses and per-rank lists to OUT. With ``DIE_AT_STEP=k`` in the environment,
rank 1 exits (code 3) when step k starts, or with ``HANG=1`` sleeps there for an hour. A harmony-opt error is one line on stderr and exit code 2,
as from the CLI.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from harmony_opt.core.errors import HarmonyOptError  # noqa: E402
from harmony_opt.training import train  # noqa: E402
from test_train import make_plan, mlp  # noqa: E402


def torchrun_plan(mode: str, gpus: int):
    """vDP: every rank reads every layer, rank 1 updates layer 2. vPP: the forward pack 0..2 runs on
    rank 0, the backward of layer 0 on rank 1, so rank 0 reads weights that rank 1 updates."""
    if mode == "vDP":
        return make_plan(mode=mode, gpus=gpus, batch=6, microbatch_fwd=3, microbatch_bwd=1)
    return make_plan(mode=mode, gpus=gpus, batch=6, microbatch_fwd=3, microbatch_bwd=1, packs_fwd=[(0, 2)],
                     packs_bwd=[(0, 0), (1, 2), (3, 4)])


def main(argv: list[str]) -> int:
    mode, gpus, steps, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    ckpt = argv[4] if len(argv) > 4 else None
    die = os.environ.get("DIE_AT_STEP")
    if die is not None and os.environ.get("RANK") == "1":
        from harmony_opt.runtime.executor import Executor
        run = Executor.run_iteration

        def dying(self, step, x, y):
            if step == int(die):
                if os.environ.get("HANG"):      # stop answering instead of dying (the test stops it)
                    import time
                    time.sleep(3600)
                os._exit(3)
            return run(self, step, x, y)
        Executor.run_iteration = dying
    torch.set_num_threads(1)
    plan = torchrun_plan(mode, gpus)
    try:
        res = train(mlp(), plan, steps=steps, progress=False, checkpoint_dir=ckpt,
                    resume=len(argv) > 5 and argv[5] == "resume")
    except HarmonyOptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ["RANK"] == "0":
        torch.save({"weights": res.weights, "losses": res.losses, "pids": res.rank_pids,
                    "peaks": res.peak_device_bytes, "backend": res.backend}, out)
    else:
        print(f"rank {os.environ['RANK']}: {len(res.rank_pids)} result(s), {len(res.losses)} losses")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
