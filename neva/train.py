"""``python -m neva.train +stage=pretrain|finetune [overrides]`` (or ``neva-train``): the main job.

The last line printed on stdout is the path of the stage's consolidated checkpoint, so scripts can chain stages.
NeMo NeVA keys on the command line are rewritten or refused with a reason before Hydra reads them
(``neva.nemo_keys``, docs/NEMO.md).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from neva.config import CONFIG_DIR, to_train_config
from neva.errors import ConfigError, entry_point, error_line, exit_on_input_error
from neva.nemo_keys import rewrite_overrides

log = logging.getLogger("neva.train")

STAGE_HELP = (
    "neva.train needs a stage: `python -m neva.train +stage=pretrain` (train the projector on image captions), "
    "`python -m neva.train +stage=finetune` (projector + LLM on instructions; starts from the pretrain output) or "
    "`python -m neva.train +stage=dpo` (preference pairs; starts from the finetune output)."
)


def sweep_job_exp_dir(dcfg: DictConfig) -> None:
    """Under ``-m`` (Hydra multirun), each job trains into its own ``<hydra.sweep.dir>/<its swept values>`` (e.g.
    ``outputs/pretrain/sweep/model.optim.lr-0.001``), so that jobs never resume or overwrite each other's checkpoints
    and rerunning the same sweep resumes each job from its own. A job whose overrides set ``exp_manager.exp_dir``
    keeps it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hc = HydraConfig.get()

    def key(override: str) -> str:
        return override.lstrip("+~").split("=", 1)[0]

    if any(key(o) == "exp_manager.exp_dir" for o in hc.overrides.task):
        return
    # The swept keys are those given several values on the command line; the job's value of each names its folder
    # (not every override: the name must stay a short, valid file name).
    parsed = OverridesParser.create().parse_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    # `key-value` joined by `_`: no `=` or `,`, which a Hydra override of a path (resume_from_checkpoint, exp_dir,
    # restore_from_path) could only hold quoted.
    values = sorted(o.lstrip("+~").replace("=", "-", 1) for o in hc.overrides.task if key(o) in swept)
    name = "_".join(values).replace(os.sep, "_")
    dcfg.exp_manager.exp_dir = os.path.join(hc.sweep.dir, name or f"job{hc.job.num}")


def _command_line() -> list[str]:
    """The overrides Hydra applied to this job (NeMo keys rewritten; a multirun job's own values)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# An absolute path: a console script (`neva-train`) runs this module as an installed app, where Hydra would look for
# the configs as a Python package (neva.configs is a data directory, not a package).
@hydra.main(config_path=CONFIG_DIR, config_name="neva", version_base=None)
def main(dcfg: DictConfig) -> None:
    if dcfg.get("stage") is None:
        print(STAGE_HELP, file=sys.stderr)
        sys.exit(2)
    from neva.data.skips import DataQualityError
    from neva.training.guards import NothingTrained

    try:
        # The rule of cli again, inside the job: an input error leaves the job as SystemExit, which Hydra lets through
        # without adding its own "Error executing job" line.
        with exit_on_input_error():
            sweep_job_exp_dir(dcfg)
            cfg = to_train_config(dcfg, _command_line())
            from neva.checkpoint.hf_start import imported_start
            from neva.checkpoint.trained_with import given_data_keys, inherit_trained_with

            cfg = imported_start(cfg)  # an HF directory as model.restore_from_path: imported once, under exp_dir
            # what the starting checkpoint was trained with, where this run sets nothing itself
            cfg = inherit_trained_with(cfg, given_data_keys(dcfg, _command_line()))
            from neva.checkpoint.restored_recipe import restored_recipe

            cfg = restored_recipe(cfg, _command_line())  # a restored model's size picks its recipe, not tiny's
            from neva.planner.forecast import forecast_line
            from neva.training.run import run
            from neva.training_eval import in_training_eval

            # model.eval's benchmarks are read and checked here, before anything is built
            final = run(cfg, forecast=forecast_line, evaluation=in_training_eval(cfg))
    except (DataQualityError, NothingTrained) as err:
        # Training ran but did not train what was asked (end-of-run checks): no final checkpoint, what it wrote
        # before stays, and exit 1 tells this apart from a refused input (2, neva.errors).
        print(error_line(err), file=sys.stderr)
        sys.exit(1)
    if final is not None:
        print(os.fspath(Path(final).resolve()), flush=True)


@entry_point
def cli(argv: list[str] | None = None) -> None:
    """The command line (``argv``: default ``sys.argv[1:]``, which Hydra reads): NeMo keys first (Hydra would refuse
    them with "use +key"), then Hydra. A bad input anywhere, on any rank, is one line and exit status 2
    (``neva.errors``)."""
    # Hydra then raises a refused override instead of printing its own report, so that the one rule of neva.errors
    # reports it (and a bug in the job keeps its whole traceback).
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.argv[1:] = rewrite_overrides(sys.argv[1:] if argv is None else argv)
    if not _names_a_stage(sys.argv[1:]):
        # Before Hydra: its run directory (<exp_dir>/hydra/...) is made before the job starts, and without a stage
        # exp_dir is `outputs/None`.
        raise ConfigError(STAGE_HELP)
    try:
        main()
    except Exception as err:  # Hydra's "use +key" for a misspelled key: the schema's "did you mean" at once
        from neva.config import misspelled_override

        better = misspelled_override(err)
        if better is None:
            raise
        raise better from None


def _names_a_stage(args: list[str]) -> bool:
    """An override sets ``stage`` or chooses a config that selects one in its defaults (``+preset=``,
    ``+canary=``: ``- /stage: ...``), or Hydra options (another config, --help, --cfg) leave it to Hydra to say."""
    flags = [a for a in args if a.startswith("-") and a not in ("-m", "--multirun", "--debug")]
    return bool(flags) or any(_selects_stage(a) for a in args)


_STAGE_DEFAULT = re.compile(r"^\s*-\s*/?stage\s*:", re.M)


def _selects_stage(arg: str) -> bool:
    key, _, value = arg.lstrip("+~").partition("=")
    if key == "stage":
        return True
    chosen = Path(CONFIG_DIR) / key / f"{value}.yaml"  # a group choice (a sweep's list is left to Hydra)
    return "," not in value and chosen.is_file() and bool(_STAGE_DEFAULT.search(chosen.read_text()))


if __name__ == "__main__":
    cli()
