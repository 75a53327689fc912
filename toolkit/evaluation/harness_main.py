"""``toolkit-eval-harness``: lm-evaluation-harness tasks on a toolkit checkpoint (options + ``run``).

    toolkit-eval-harness data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \\
        --tasks hellaswag,lambada_openai --num-fewshot 0 --batch-size 16 --output-path results.json

``--path`` takes a toolkit checkpoint (transformer_lm or the Llama family), a fairseq
``transformer_lm`` checkpoint, a sharded checkpoint folder (consolidated on the fly), a
``model.safetensors`` export or the ``model.pt`` of ``toolkit-export --from hf`` (then DATA is
that folder: its ``tokenizer.json`` is used). Tasks under ``--include-path`` (harness YAML) are
found without indexing the harness's own thousands when every task asked for is there.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional

from toolkit.config.commands import EvalHarnessConfig  # noqa: F401  (its options, torch-free for --help)
from toolkit.config.flag_types import example_limit  # noqa: F401  (--limit's type, imported from here before)
from toolkit.core import yaml_syntax
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write
from toolkit.core.preflight import check_writable_folder
from toolkit.logging.setup import setup_logging

logger = logging.getLogger("toolkit_cli.eval_harness")


def require_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise UserError("lm-eval is not installed; pip install lm-eval (or: pip install toolkit[eval])") from None
    return lm_eval


def task_names(tasks: Optional[str]) -> List[str]:
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    if not names:
        raise UserError("--tasks is required: harness task names, comma-separated (e.g. --tasks hellaswag)")
    return names


def task_manager(names: List[str], include_path: Optional[str]):
    """The harness's TaskManager: only ``include_path`` when it holds every task asked for."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not os.path.isdir(include_path):
            raise UserError(f"--include-path {include_path}: no such folder; give a folder of harness task YAML")
        check_task_yaml(include_path)
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not set(names) - set(local.all_tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = sorted(set(names) - set(manager.all_tasks))
    if unknown:
        raise UserError(
            f"--tasks: unknown task(s) {', '.join(unknown)}; see lm-eval ls tasks, or give "
            f"--include-path with their YAML"
        )
    return manager


def check_task_yaml(include_path: str) -> None:
    """Every YAML under ``--include-path`` parses, else one line naming the file and line: the harness skips
    a file it cannot parse with a warning, so a typo would otherwise surface as "unknown task"."""
    error = yaml_syntax.first_syntax_error(include_path)
    if error is not None:
        raise UserError(f"--include-path {error}; fix the file or move it out of the folder")


def evaluate(
    lm,
    names: List[str],
    manager,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    seed: int = 1234,
    log_samples: bool = False,
    bootstrap_iters: int = 0,
    chat: Optional[bool] = None,
) -> Dict[str, Any]:
    """The harness's ``simple_evaluate`` on a ToolkitLM (also used during training). ``chat``: the contexts
    rendered with the model's chat template, the few-shot examples as turns (True) or in one user turn (False);
    None: no template."""
    import lm_eval

    return lm_eval.simple_evaluate(
        apply_chat_template=chat is not None,
        fewshot_as_multiturn=bool(chat),
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        bootstrap_iters=bootstrap_iters,
    )


def check_output_path(path: str) -> None:
    """--output-path checked before the evaluation (a probe file written beside it), not after: a refusal at
    the end would lose the whole evaluation's results."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"--output-path {path}: folder {folder} does not exist; create it first")
    if os.path.isdir(path):
        raise UserError(
            f"--output-path {path}: is a folder; give a file name (e.g. {os.path.join(path, 'results.json')})"
        )
    check_writable_folder("--output-path", folder)


def write_results(results: Dict[str, Any], path: str) -> None:
    from lm_eval.utils import handle_non_serializable

    check_output_path(path)
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        f.write("\n")


def run(cfg: EvalHarnessConfig) -> Dict[str, Any]:
    """Evaluate, print the harness's table, write ``--output-path``; returns the results dict."""
    setup_logging(cfg.log_file)
    require_lm_eval()
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to evaluate")
    names = task_names(cfg.tasks)
    if cfg.output_path:
        check_output_path(cfg.output_path)
    if cfg.batch_size < 1:
        raise UserError(f"--batch-size {cfg.batch_size}: must be at least 1")
    from lm_eval.utils import make_table

    from toolkit.evaluation.harness import ToolkitLM

    manager = task_manager(names, cfg.include_path)
    lm = ToolkitLM(
        path=cfg.path,
        data=cfg.data or None,
        batch_size=cfg.batch_size,
        device=cfg.device,
        context_window=cfg.context_window,
        max_gen_toks=cfg.max_gen_toks,
        seed=cfg.seed,
        cpu_matmul=cfg.cpu_matmul,
        chat_template=cfg.chat_template,
    )
    chat = None
    if cfg.apply_chat_template:
        lm.chat_template(True)  # a folder without a template is refused before any request
        chat = cfg.fewshot_as_multiturn != "false"
    elif cfg.chat_template or cfg.fewshot_as_multiturn != "auto":
        raise UserError("--chat-template and --fewshot-as-multiturn apply with --apply-chat-template only")
    args = (cfg.num_fewshot, cfg.limit, cfg.seed, cfg.log_samples, cfg.bootstrap_iters, chat)
    results = evaluate(lm, names, manager, *args)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if cfg.output_path:
        write_results(results, cfg.output_path)
        logger.info(f"wrote {cfg.output_path}")
    return results
