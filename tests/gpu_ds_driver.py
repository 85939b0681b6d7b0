"""Trains recipes/deepspeed/train.py several times in one process, one launch for ZeRO-1/2/3
(tests/test_gpu_suite.py; each launch of DeepSpeed costs seconds of imports and start-up).

    hetccl deepspeed --vendors 1+1 --num_gpus 2 tests/gpu_ds_driver.py RUNS.json
    torchrun --nproc_per_node 1 tests/gpu_ds_driver.py RUNS.json --comm_backend nccl

RUNS.json: a list of argument lists for the recipe's run(); arguments after RUNS.json are
appended to each (the launcher's --local_rank=N is dropped: the recipe reads LOCAL_RANK).
"""
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.join(os.path.dirname(HERE), "recipes", "deepspeed", "train.py")


def main(argv):
    argv = [a for a in argv if not a.startswith("--local_rank")]
    runs_file, extra = argv[0], argv[1:]
    spec = importlib.util.spec_from_file_location("hetccl_ds_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with open(runs_file) as f:
        runs = json.load(f)
    for run_argv in runs:
        recipe.run(run_argv + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
