"""What ``toolkit-generate`` and ``toolkit-interactive`` do, as library functions (the CLI only parses).

    toolkit-generate data-bin/wt --path ck/checkpoint_best.pt --task language_modeling \\
        --sample-break-mode eos --prefix-size 4 --beam 5 --nbest 2
    echo "The tower is" | toolkit-interactive data-bin/wt --path ck/checkpoint_best.pt \\
        --sampling --sampling-topk 10 --beam 1

Prompts are encoded with the data-bin's BPE (``bpe.json``); ``D-`` lines are decoded with it.

A model imported with ``toolkit-export --from hf`` uses its own tokenizer instead (``tokenizer.json`` of
DATA, or the copy a data-bin binarized with it keeps; :mod:`toolkit.inference.model_tokenizer`): a prompt
is what ``AutoTokenizer(line)["input_ids"]`` gives, its first id (Llama's BOS) the context generation
starts from, so greedy output is transformers' ``generate(do_sample=False)``; ``D-`` is the tokenizer's
``decode(..., skip_special_tokens=True)``. ``--path`` may name the imported folder itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from typing import ContextManager, Dict, Iterator, List, Optional, TextIO, Tuple

import torch

from toolkit import inference
from toolkit.inference import model_tokenizer as hf_ids
from toolkit.config import options
from toolkit import ops
from toolkit.core.errors import UserError
from toolkit.generation.config import GenerationConfig
from toolkit.generation.output import hypothesis_lines, post_process
from toolkit.generation.sequence_generator import BrokenModelOutput, SequenceGenerator
from toolkit.logging.setup import setup_logging
from toolkit.logging.step_progress import StepProgress
from toolkit.tokenizers import load_tokenizer_for_data_bin
from toolkit.config.commands import GenerationCommandConfig, GenerateConfig, InteractiveConfig  # noqa: F401  (torch-free for --help)

logger = logging.getLogger("toolkit.generation")


class Session:
    """Models, dictionary, tokenizer and generator, loaded once per command."""

    def __init__(self, cfg: GenerationCommandConfig, gen_cfg: GenerationConfig, task_overrides: Dict):
        setup_logging(cfg.log_file)
        if cfg.path is None:
            raise UserError("--path is required: the checkpoint to generate with")
        if gen_cfg.sampling and gen_cfg.nbest != gen_cfg.beam:
            raise UserError(f"--sampling requires --nbest ({gen_cfg.nbest}) to be equal to --beam ({gen_cfg.beam})")
        torch.manual_seed(cfg.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
        ops.select(cfg.cpu_matmul, self.device)
        self.models, self.task, self.train_args = inference.load_ensemble(
            checkpoint_files(cfg.path), cfg.data, self.device
        )
        if task_overrides:  # the task only: the models keep the shapes they were trained with
            values = {**vars(self.train_args), "data": self.task.cfg.data, **task_overrides}
            self.task = type(self.task).setup_task(options.config_from_args(type(self.task.cfg), values))
        if cfg.fp16:
            self.models = [m.half() for m in self.models]
        self.dictionary = self.task.dictionary
        data_dir = self.task.model_files_dir()
        self.tokenizer = load_tokenizer_for_data_bin(data_dir)
        self.model_tokenizer = hf_ids.load_model_tokenizer(data_dir, self.dictionary)
        self.bos = self.dictionary.bos() if self.task.cfg.add_bos_token else self.dictionary.eos()
        self.generators: Dict[int, SequenceGenerator] = {}
        self.cfg, self.gen_cfg = cfg, gen_cfg
        self.num_sentences, self.num_tokens, self.seconds = 0, 0, 0.0

    def generate(self, prompts: List[torch.Tensor], context: Optional[int] = None) -> List[List[Dict]]:
        """Hypotheses per prompt, each prompt read after ``context`` (default: the task's ``</s>`` or ``<s>``)."""
        context = self.bos if context is None else context
        if context not in self.generators:
            self.generators[context] = SequenceGenerator(self.models, self.dictionary, self.gen_cfg, bos=context)
        start = time.time()
        try:
            hypos = self.generators[context].generate(prompts)
        except BrokenModelOutput as e:
            raise UserError(f"{self.cfg.path}: {e}") from None
        self.seconds += time.time() - start
        self.num_sentences += len(prompts)
        self.num_tokens += sum(len(h[0]["tokens"]) for h in hypos if h)
        return hypos

    def string(self, tokens: torch.Tensor) -> str:
        """A prompt's text: the model's tokenizer decodes it (its tokens are byte-level pieces), else dict.txt's."""
        if self.model_tokenizer is not None:
            return hf_ids.decode_ids(self.model_tokenizer, tokens)
        return post_process(self.dictionary.string(tokens), self.cfg.post_process)

    def hypothesis_lines(self, sample_id: int, hypos: List[Dict]) -> List[str]:
        decode = None
        if self.model_tokenizer is not None:
            decode = lambda tokens: hf_ids.decode_ids(self.model_tokenizer, tokens)  # noqa: E731
        return hypothesis_lines(
            sample_id, hypos, self.gen_cfg.nbest, self.dictionary, self.tokenizer, self.cfg.post_process, decode
        )

    def log_summary(self) -> None:
        logger.info("NOTE: hypothesis and token scores are output in base 2")
        secs = max(self.seconds, 1e-9)
        logger.info(
            f"Translated {self.num_sentences:,} sentences ({self.num_tokens:,} tokens) in {self.seconds:.1f}s "
            f"({self.num_sentences / secs:.2f} sentences/s, {self.num_tokens / secs:.2f} tokens/s)"
        )


def checkpoint_files(paths: str) -> str:
    """``--path`` with each model folder (one holding ``model.pt``, e.g. what ``toolkit-export --from hf`` wrote)
    replaced by its checkpoint file; files and sharded checkpoint folders stay as given."""
    from toolkit.compat.fairseq.hub import CHECKPOINT_NAMES, checkpoint_path

    parts = paths.split(":")
    for i, part in enumerate(parts):
        if os.path.isdir(part) and any(os.path.isfile(os.path.join(part, n)) for n in CHECKPOINT_NAMES):
            parts[i] = checkpoint_path(part, None)
    return ":".join(parts)


def split_prompts(session: Session, dataset, ids: List[int], prefix_size: int) -> List[torch.Tensor]:
    """fairseq's prompts from a split: the target's first ``prefix_size`` tokens, else the source
    without its leading </s> (or <s>)."""
    prompts = []
    for i in ids:
        sample = dataset[i]
        if prefix_size > 0:
            prompts.append(sample["target"][:prefix_size].long())
        else:
            source = sample["source"].long()
            prompts.append(source[1:] if len(source) and int(source[0]) == session.bos else source)
    return prompts


def generate_main(
    cfg: GenerateConfig, gen_cfg: GenerationConfig, task_overrides: Optional[Dict] = None, out: TextIO = sys.stdout
) -> Session:
    """Generate from every sample of ``--gen-subset``, printing S-/T-/H-/D-/P- lines."""
    session = Session(cfg, gen_cfg, task_overrides or {})
    dataset = session.task.load_dataset(cfg.gen_subset)
    batch_size = cfg.batch_size or 16
    progress = StepProgress(
        (len(dataset) + batch_size - 1) // batch_size, f"generate {cfg.gen_subset}", logger_name=logger.name
    )
    for first in range(0, len(dataset), batch_size):
        ids = list(range(first, min(first + batch_size, len(dataset))))
        progress.advance(f"samples {first}-{ids[-1]} of {len(dataset)}")
        try:
            hypos = session.generate(split_prompts(session, dataset, ids, gen_cfg.prefix_size))
        except UserError as e:
            if gen_cfg.prefix_size > 0:
                raise
            eos = (
                ""
                if session.task.cfg.sample_break_mode == "eos"
                else ", or --sample-break-mode eos for one line per sample"
            )
            raise UserError(
                f"{e} (without --prefix-size each whole sample of --gen-subset is a prompt: give --prefix-size N{eos})"
            ) from None
        if cfg.quiet:
            continue
        for sample_id, sample_hypos in zip(ids, hypos):
            sample = dataset[sample_id]
            print(f"S-{sample_id}\t{session.string(sample['source'])}", file=out)
            print(f"T-{sample_id}\t{session.string(sample['target'])}", file=out)
            for line in session.hypothesis_lines(sample_id, sample_hypos):
                print(line, file=out)
    progress.close()
    session.log_summary()
    return session


def buffered_read(stream: TextIO, buffer_size: int) -> Iterator[List[str]]:
    buffer: List[str] = []
    for number, line in enumerate(stream, 1):
        buffer.append(clean_input_line(line.strip(), number))
        if len(buffer) >= buffer_size:
            yield buffer
            buffer = []
    if buffer:
        yield buffer


def clean_input_line(line: str, number: int) -> str:
    """Invalid UTF-8 (read as surrogate escapes) and NUL characters become U+FFFD, with a warning:
    the prompt then holds an unknown word, and the user is told instead of silently getting ``<unk>``."""
    bad = sum(1 for ch in line if ch == "\0" or "\udc80" <= ch <= "\udcff")
    if not bad:
        return line
    logger.warning(
        f"input line {number}: {bad} invalid UTF-8 byte(s) or NUL character(s), replaced by U+FFFD "
        f"(an unknown word to the model); give UTF-8 text"
    )
    return "".join("\ufffd" if ch == "\0" or "\udc80" <= ch <= "\udcff" else ch for ch in line)


def open_input(path: str) -> ContextManager[TextIO]:
    """stdin or a file as UTF-8 text whose invalid bytes survive as surrogate escapes (see clean_input_line)."""
    if path == "-":  # stdin stays open: the process may still read or close it
        return contextlib.nullcontext(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape"))
    if not os.path.isfile(path):
        raise UserError(f"--input {path}: no such file; give a text file, one prompt per line, or - for stdin")
    return open(path, encoding="utf-8", errors="surrogateescape")


def encode_prompt(session: Session, line: str) -> torch.Tensor:
    """The prompt's ids; with the model's own tokenizer its context id (BOS) first, see :func:`generate_prompts`."""
    if session.model_tokenizer is not None:
        return hf_ids.encode_ids(session.model_tokenizer, line)
    if session.dictionary.fixed_ids:
        raise UserError(
            f"{session.task.cfg.data}: dict.txt is a tokenizer's vocabulary (toolkit-export --from hf) but "
            f"no tokenizer.json is beside it; give the folder the import wrote as DATA"
        )
    pieces = session.tokenizer.encode(line) if session.tokenizer is not None else line
    return session.dictionary.encode_line(pieces, append_eos=False).long()


def generate_prompts(session: Session, prompts: List[torch.Tensor]) -> Tuple[List[torch.Tensor], List[List[Dict]]]:
    """(what S- prints, hypotheses) per prompt. With the model's own tokenizer a prompt's first id is the
    context transformers starts from (prompts grouped by it); a context that is text (a tokenizer without
    BOS, e.g. Qwen2's) is printed as part of the prompt and of each hypothesis (it has no score)."""
    if session.model_tokenizer is None:
        return prompts, session.generate(prompts)
    shown: List[torch.Tensor] = list(prompts)
    out: List[List[Dict]] = [[] for _ in prompts]
    for context, group in hf_ids.group_by_context(prompts, session.bos).items():
        hypos = session.generate([p for _, p in group], context)
        for (index, rest), h in zip(group, hypos):
            is_text = context not in (session.dictionary.bos(), session.dictionary.eos())
            shown[index] = prompts[index] if is_text else rest
            out[index] = hf_ids.with_context(h, context) if is_text else h
    return shown, out


def interactive_main(
    cfg: InteractiveConfig,
    gen_cfg: GenerationConfig,
    task_overrides: Optional[Dict] = None,
    stdin: Optional[TextIO] = None,
    out: TextIO = sys.stdout,
) -> Session:
    """One prompt per input line; S-/W-/H-/D-/P- lines per prompt, in input order."""
    buffer_size = max(cfg.buffer_size, 1)
    batch_size = cfg.batch_size or 1
    if batch_size > buffer_size:
        raise UserError(f"--batch-size {batch_size} cannot be larger than --buffer-size {buffer_size}")
    session = Session(cfg, gen_cfg, task_overrides or {})
    if buffer_size > 1:
        logger.info(f"Sentence buffer size: {buffer_size}")
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    logger.info("Type the input sentence and press return:")
    run = run_interactive if cfg.chat_template is None else chat_runner(session, cfg.chat_template)
    if stdin is not None:
        run(session, stdin, buffer_size, batch_size, out)
    else:
        with open_input(cfg.input) as stream:
            run(session, stream, buffer_size, batch_size, out)
    session.log_summary()
    return session


def chat_runner(session: Session, spec: str):
    """``--chat-template``: one conversation, a user turn per input line. Each prompt is the whole conversation
    rendered with the template and its generation prompt, encoded as ``apply_chat_template(tokenize=True)``
    encodes it (the tokenizer's own specials not added: the template writes them); the best hypothesis, decoded,
    (what it adds to its prompt) is the assistant's turn that the next prompt renders."""
    from toolkit.data.chat_template import ChatTemplate

    if session.model_tokenizer is None:
        raise UserError(
            f"--chat-template {spec}: needs the model's own tokenizer (a model imported with toolkit-export "
            f"--from hf, or a data-bin binarized with its tokenizer); {session.task.cfg.data} has none"
        )
    template = ChatTemplate.load(spec)

    def run(session: Session, stream: TextIO, _buffer: int, _batch: int, out: TextIO) -> None:
        history: List[Dict] = []
        for sample_id, line in enumerate(line.rstrip("\n") for line in stream):
            history.append({"role": "user", "content": line})
            prompt = hf_ids.chat_ids(template, session.model_tokenizer, history, f"--chat-template {spec}")
            started = time.time()
            (shown,), (hypos,) = generate_prompts(session, [prompt])
            print(f"S-{sample_id}\t{session.string(shown)}", file=out)
            print(f"W-{sample_id}\t{time.time() - started:.3f}\tseconds", file=out)
            for printed in session.hypothesis_lines(sample_id, hypos):
                print(printed, file=out)
            out.flush()
            generated = hypos[0]["tokens"][len(shown) :] if hypos else []  # a hypothesis repeats its prompt
            reply = hf_ids.decode_ids(session.model_tokenizer, generated).strip()
            history.append({"role": "assistant", "content": reply})

    return run


def run_interactive(session: Session, stream: TextIO, buffer_size: int, batch_size: int, out: TextIO) -> None:
    """Buffer by buffer, so a user typing prompts sees each buffer's results before typing more."""
    start_id = 0
    for lines in buffered_read(stream, buffer_size):
        prompts = [encode_prompt(session, line) for line in lines]
        for first in range(0, len(prompts), batch_size):
            started = time.time()
            batch, hypos = generate_prompts(session, prompts[first : first + batch_size])
            per_prompt = (time.time() - started) / len(batch)
            for offset, (prompt, sample_hypos) in enumerate(zip(batch, hypos)):
                sample_id = start_id + first + offset
                print(f"S-{sample_id}\t{session.string(prompt)}", file=out)
                print(f"W-{sample_id}\t{per_prompt:.3f}\tseconds", file=out)
                for line in session.hypothesis_lines(sample_id, sample_hypos):
                    print(line, file=out)
        out.flush()
        start_id += len(lines)
