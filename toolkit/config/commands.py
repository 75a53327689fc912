"""The options of the commands other than toolkit-train (whose options are ``toolkit.config``'s sections).

They live here, apart from the code that runs the command (which imports torch), so that
``toolkit-<command> --help`` and every argument error exit before torch is imported. The modules that use
them re-export each class under its old name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from toolkit.config import CPU_MATMUL_CHOICES, CPU_MATMUL_HELP, opt
from toolkit.config.flag_types import count_or_zero, example_limit, positive_int

ENCODING_ERRORS = ("strict", "replace", "ignore")
DOCUMENT_SEPARATORS = ("newline", "blank_line")
"""``--encoding-errors``: Python's ``errors=`` for a text input that is not valid UTF-8."""


# toolkit-generate / toolkit-interactive: search and output (toolkit/generation/)


@dataclass
class GenerationConfig:
    beam: int = opt(5, "beam size (with --sampling: the number of samples per prompt)")
    nbest: int = opt(1, "number of hypotheses to output")
    max_len_a: float = opt(
        0.0,
        "generate sequences of maximum length ax + b, where x is the source length "
        "(for a language model: the prompt length + 1)",
    )
    max_len_b: int = opt(
        200,
        "generate sequences of maximum length ax + b, where x is the source length; for a language model the "
        "length counts the prompt, as fairseq's does (--max-new-tokens counts only what is generated)",
    )
    min_len: int = opt(1, "minimum generation length")
    lenpen: float = opt(1.0, "length penalty: <1.0 favors shorter, >1.0 favors longer sentences")
    unkpen: float = opt(0.0, "unknown word penalty: <0 produces more unks, >0 produces fewer")
    unnormalized: bool = opt(False, "compare unnormalized hypothesis scores")
    no_repeat_ngram_size: int = opt(0, "ngram blocking such that this size ngram cannot be repeated in the generation")
    sampling: bool = opt(False, "sample hypotheses instead of using beam search")
    sampling_topk: int = opt(-1, "sample from top K likely next words instead of all words")
    sampling_topp: float = opt(
        -1.0, "sample from the smallest set whose cumulative probability mass exceeds p for next words"
    )
    temperature: float = opt(1.0, "temperature for generation")
    prefix_size: int = opt(0, "initialize generation by target prefix of given length")
    max_new_tokens: Optional[int] = opt(
        None,
        "generate at most this many tokens after the prompt, whatever its length (transformers' max_new_tokens; "
        "the hub's max_len); given, it replaces --max-len-a/--max-len-b",
        type=positive_int,
    )


# toolkit-generate / toolkit-interactive: what to load and read (toolkit/inference/generate.py)


@dataclass
class GenerationCommandConfig:
    data: str = opt(None, "the data-bin folder (its dictionary and BPE)", positional=True)
    path: Optional[str] = opt(None, "checkpoint to generate with; several joined by ':' form an ensemble")
    batch_size: Optional[int] = opt(None, "prompts per batch", aliases=("--max-sentences",), type=positive_int)
    seed: int = opt(1, "random seed (sampling)")
    cpu: bool = opt(False, "generate on CPU even when a GPU is present")
    cpu_matmul: str = opt("auto", CPU_MATMUL_HELP, choices=CPU_MATMUL_CHOICES)
    fp16: bool = opt(False, "run the model in fp16")
    post_process: Optional[str] = opt(
        None,
        "post-process the H- text by removing BPE markers: sentencepiece, subword_nmt (--remove-bpe alone), ...",
        aliases=("--remove-bpe",),
    )
    log_file: Optional[str] = opt(None, "also write the log to this file")


@dataclass
class GenerateConfig(GenerationCommandConfig):
    gen_subset: str = opt("test", "data split to take prompts from")
    quiet: bool = opt(False, "only print the summary")
    results_path: Optional[str] = opt(
        None, "write the output to RESULTS_PATH/generate-{gen_subset}.txt instead of stdout (fairseq's file name)"
    )


@dataclass
class InteractiveConfig(GenerationCommandConfig):
    buffer_size: int = opt(0, "read this many sentences into a buffer before processing them", type=count_or_zero)
    input: str = opt("-", "file to read from; use - for stdin")
    chat_template: Optional[str] = opt(
        None,
        "chat: each input line is the user's next turn of one conversation, rendered with this template (a "
        "tokenizer folder such as the model's import, a tokenizer_config.json or a .jinja file) with the "
        "generation prompt; the reply (the best hypothesis) becomes the assistant's turn",
    )


# toolkit-eval-lm (toolkit/inference/eval_lm_main.py)


@dataclass
class EvalLMConfig:
    data: str = opt("", "the data-bin folder (several joined by ':': the first is evaluated)", positional=True)
    path: Optional[str] = opt(
        None, "checkpoint to evaluate (toolkit or fairseq); several joined by ':' form an ensemble"
    )
    task: str = opt("language_modeling", "task (only language_modeling)")
    criterion: Optional[str] = opt(
        None,
        "accepted for fairseq compatibility: eval-lm scores with the model's log-probabilities whatever the criterion",
    )
    gen_subset: str = opt("test", "data split to evaluate")
    tokens_per_sample: Optional[int] = opt(
        None, "tokens per block, context included (fairseq's meaning; default: the training value)"
    )
    context_window: int = opt(
        0,
        "earlier tokens given as context to each block: each block scores tokens-per-sample minus this many new tokens",
    )
    sample_break_mode: str = opt(
        "none",
        "how the split is cut into blocks (as the language_modeling task)",
        choices=["none", "complete", "complete_doc", "eos"],
    )
    add_bos_token: bool = opt(False, "prepend <s> to every block (its score is not counted)")
    max_tokens: Optional[int] = opt(None, "maximum tokens in a batch (default 36000, as fairseq)", type=positive_int)
    batch_size: Optional[int] = opt(
        None, "number of blocks in a batch", aliases=("--max-sentences",), type=positive_int
    )
    softmax_batch: int = opt(0, "normalize at most this many positions at once (memory only)", type=count_or_zero)
    output_word_probs: bool = opt(False, "log each word with its log-probability (natural log, fairseq's format)")
    output_word_stats: bool = opt(False, "log per-word counts and summed log-probabilities")
    post_process: Optional[str] = opt(
        None,
        "merge BPE continuations: subword_nmt / '@@ ' (alias --remove-bpe; bare flag = subword_nmt)",
        aliases=("--remove-bpe",),
    )
    model_overrides: str = opt("{}", "a Python dict of model options replacing the checkpoint's")
    max_target_positions: Optional[int] = opt(
        None, "accepted for fairseq compatibility (a task option eval-lm does not use; see --model-overrides)"
    )
    skip_invalid_size_inputs_valid_test: bool = opt(
        False, "accepted: eval-lm always skips blocks longer than the model's positions, as fairseq"
    )
    num_shards: int = opt(1, "evaluate only every num-shards-th batch ...", type=positive_int)
    shard_id: int = opt(0, "... starting at this one")
    seed: int = opt(1, "random seed (orders the batches, as fairseq)")
    fp16: bool = opt(False, "evaluate in fp16")
    cpu: bool = opt(False, "evaluate on CPU even when a GPU is present")
    cpu_matmul: str = opt("auto", CPU_MATMUL_HELP, choices=CPU_MATMUL_CHOICES)
    num_workers: int = opt(1, "accepted for fairseq compatibility (batches are built in this process)")
    quiet: bool = opt(False, "accepted for fairseq compatibility (eval-lm only prints final scores anyway)")
    results_path: Optional[str] = opt(None, "accepted for fairseq compatibility (fairseq-eval-lm writes nothing there)")
    required_batch_size_multiple: int = opt(
        8, "accepted for fairseq compatibility (fairseq-eval-lm does not apply it either)", type=positive_int
    )
    distributed_world_size: int = opt(
        1, "accepted for fairseq compatibility (eval-lm runs in one process)", type=positive_int
    )
    model_parallel_size: int = opt(
        1, "accepted for fairseq compatibility (the model is evaluated whole)", type=positive_int
    )
    log_format: Optional[str] = opt(None, "progress format", choices=["json", "simple", "tqdm", "none"])
    log_interval: int = opt(100, "log progress every N batches", type=positive_int)
    no_progress_bar: bool = opt(False, "disable the progress bar")
    log_file: Optional[str] = opt(None, "also write the log to this file")


# toolkit-preprocess (toolkit/data/preprocess.py)


@dataclass
class PreprocessConfig:
    only_source: bool = field(
        default=False,
        metadata={
            "help": "only process the source language: language-model data (the only mode here; accepted for "
            "fairseq compatibility)"
        },
    )
    trainpref: Optional[str] = field(
        default=None,
        metadata={
            "help": "train file (fairseq's train prefix; with --only-source it is the file itself)",
            "metavar": "FP",
        },
    )
    validpref: Optional[str] = field(
        default=None,
        metadata={"help": "valid file(s), comma separated: they become valid, valid1, valid2, ...", "metavar": "FP"},
    )
    testpref: Optional[str] = field(
        default=None,
        metadata={"help": "test file(s), comma separated: they become test, test1, test2, ...", "metavar": "FP"},
    )
    destdir: str = field(default="data-bin", metadata={"help": "destination folder", "metavar": "DIR"})
    srcdict: Optional[str] = field(
        default=None,
        metadata={"help": "reuse this dict.txt instead of building one from the train file", "metavar": "FP"},
    )
    thresholdsrc: int = field(
        default=0, metadata={"help": "map words appearing fewer than this many times to <unk>", "metavar": "N"}
    )
    nwordssrc: int = field(
        default=-1,
        metadata={
            "help": "number of dictionary entries to keep, the 4 special symbols included (-1: all)",
            "metavar": "N",
        },
    )
    padding_factor: int = field(
        default=8,
        metadata={"help": "pad the dictionary size to a multiple of this (madeupwordNNNN fillers)", "metavar": "N"},
    )
    workers: int = field(default=1, metadata={"help": "number of parallel worker processes", "metavar": "N"})
    dataset_impl: str = field(
        default="mmap", metadata={"help": "output dataset implementation", "choices": ["mmap"], "metavar": "FORMAT"}
    )
    dict_only: bool = field(default=False, metadata={"help": "only build the dictionary, binarize nothing"})
    joined_dictionary: bool = field(
        default=False,
        metadata={
            "help": "fairseq: one dictionary for source and target; language-model data has one side, so its "
            "dictionary already is (accepted, no effect)"
        },
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "replace an existing, non-empty --destdir; when adding splits to a data-bin (--srcdict), "
            "replace only the files of the splits written"
        },
    )
    encoding_errors: str = field(
        default="strict",
        metadata={
            "help": "what to do with bytes that are not UTF-8: stop with an error (strict), put U+FFFD in their "
            "place (replace) or drop them (ignore)",
            "choices": list(ENCODING_ERRORS),
            "metavar": "MODE",
        },
    )
    no_progress_bar: bool = field(default=False, metadata={"help": "disable the progress bars"})
    json_key: str = field(
        default="text", metadata={"help": "the key holding the text in *.jsonl[.gz|.zst] inputs", "metavar": "KEY"}
    )
    parquet_column: str = field(
        default="text",
        metadata={"help": "the column holding the text in *.parquet inputs and --hf-dataset splits", "metavar": "NAME"},
    )
    hf_dataset: Optional[str] = field(
        default=None,
        metadata={
            "help": "train on a Hugging Face datasets folder (save_to_disk, or data files) or local dataset script "
            "instead of --trainpref (pip install datasets)",
            "metavar": "PATH",
        },
    )
    hf_split: str = field(
        default="train", metadata={"help": "the --hf-dataset split binarized as train", "metavar": "NAME"}
    )
    hf_valid_split: Optional[str] = field(
        default=None,
        metadata={
            "help": "--hf-dataset split(s), comma separated, binarized as valid, valid1, ...",
            "metavar": "NAMES",
        },
    )
    num_shards: int = field(
        default=1,
        metadata={
            "help": "binarize only part --shard-id of N of every input (one job of many machines; needs --srcdict); "
            "join the parts with --merge",
            "metavar": "N",
        },
    )
    shard_id: int = field(default=0, metadata={"help": "which part of --num-shards (0-based)", "metavar": "I"})
    merge: Optional[str] = field(
        default=None,
        metadata={
            "help": "join the data-bins of --num-shards parts (comma-separated folders or a pattern such as "
            "'parts/*') into --destdir: the same bytes as one run",
            "metavar": "PARTS",
        },
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "read --hf-dataset as a stream (datasets' streaming=True), for datasets larger than memory"},
    )
    document_separator: str = field(
        default="newline",
        metadata={
            "help": "what ends a document of a text file: each line is one item (newline, fairseq's), or "
            "documents are separated by blank lines (blank_line: each paragraph one item, its newlines "
            "encoded by the tokenizer, as --sample-break-mode complete_doc reads documents). A JSON lines, "
            "Parquet or --hf-dataset record is always one document",
            "choices": list(DOCUMENT_SEPARATORS),
            "metavar": "SEP",
        },
    )
    document_files: Tuple[str, ...] = field(
        default=(), metadata={"cli": False}
    )  # the inputs holding documents (NUL-ended), set while records are converted
    chat_template: Optional[str] = field(
        default=None,
        metadata={
            "help": "binarize conversations for --task sft with this chat template: a Hugging Face tokenizer folder, "
            "its tokenizer_config.json or a .jinja file (rendered as transformers renders it, encoded by that "
            "tokenizer); records of .jsonl / .parquet / --hf-dataset holding a --messages-key list; the data-bin "
            "keeps which tokens are trained beside the tokens",
            "metavar": "T",
        },
    )
    messages_key: str = field(
        default="messages",
        metadata={"help": "with --chat-template: the key (column) holding each record's list of messages"},
    )
    train_on: str = field(
        default="assistant",
        metadata={
            "help": "with --chat-template: the tokens trained: every assistant turn (the template's {%% generation %%} "
            "spans, else each turn found by rendering the conversation's prefixes), the last one only, or all",
            "choices": ["assistant", "last-assistant", "all"],
        },
    )


# toolkit-validate (toolkit/train/validate.py)
@dataclass
class ValidateConfig:
    data: str = opt("", "the data-bin (default: the one the checkpoint was trained on)", positional=True)
    path: Optional[str] = opt(None, "checkpoint to validate (toolkit, fairseq, sharded folder, model.safetensors)")
    valid_subset: str = opt("valid", "comma-separated splits to validate on")
    max_tokens_valid: Optional[int] = opt(
        None, "maximum tokens in a batch (default: the training run's)", aliases=("--max-tokens",), type=positive_int
    )
    batch_size_valid: Optional[int] = opt(
        None,
        "samples in a batch (default: the training run's)",
        aliases=("--batch-size", "--max-sentences"),
        type=positive_int,
    )
    skip_invalid_size_inputs_valid_test: bool = opt(False, "skip samples longer than the model takes")
    model_overrides: str = opt("{}", "a Python dict of model options replacing the checkpoint's")
    task: Optional[str] = opt(
        None,
        "read DATA as this task (default: the checkpoint's), e.g. sft: an imported model's loss on the trained "
        "tokens of a chat data-bin; the options whose defaults differ between the two tasks take the new task's",
    )
    cpu: bool = opt(False, "validate on CPU even when a GPU is present")
    cpu_matmul: str = opt("auto", CPU_MATMUL_HELP, choices=CPU_MATMUL_CHOICES)
    log_format: Optional[str] = opt(None, "progress format", choices=["json", "simple", "tqdm", "none"])
    log_interval: int = opt(100, "log progress every N batches", type=positive_int)
    no_progress_bar: bool = opt(False, "disable the progress bar")
    log_file: Optional[str] = opt(None, "also write the log to this file")


# toolkit-export (toolkit/export/api.py; the torch dtypes of DTYPE_NAMES are toolkit.export.common.DTYPES)

FORMATS = ("safetensors", "onnx", "hf", "peft")
DTYPE_NAMES = ("fp32", "bf16", "fp16")
HF_CLASSES = ("auto", "xglm", "opt", "gpt2")
QUANTIZATIONS = ("mxfp4",)  # --quantize: the storages of the families' releases (their adapters' QUANTIZATIONS)


# What `toolkit-export --from hf` reads, for --help without importing torch: the families' ``HF_CLASSES`` values
# (tests/unit/test_export_family.py keeps this list equal to them).
IMPORTABLE_HF_CLASSES = (
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Glm4MoeForCausalLM",
)


@dataclass
class ExportConfig:
    path: Optional[str] = opt(
        None,
        "checkpoint to export (with --from hf: the transformers folder to import; with --from peft: the adapter folder)",
    )
    format: Optional[str] = opt(
        None,
        "what to write: safetensors (weights + config, no pickle), onnx (decoder graphs), hf (a transformers folder; "
        "a LoRA run's adapters merged) or peft (a LoRA run's adapters as PEFT saves them, its base model in base/)",
        choices=list(FORMATS),
    )
    out: Optional[str] = opt(None, "output folder, new or empty (written atomically: complete or absent)")
    force: bool = opt(
        False,
        "replace --out when it holds an earlier export (its toolkit_export.json lists "
        "every file there); never any other folder",
    )
    data: Optional[str] = opt(
        None, "data-bin with dict.txt and the BPE model (default: the one the checkpoint was trained on)"
    )
    dtype: str = opt("fp32", "weight dtype of --format safetensors|hf|peft", choices=list(DTYPE_NAMES))
    kv_cache: bool = opt(
        False,
        "--format onnx: also write decoder_with_past.onnx, which takes and "
        "returns per-layer keys/values [B, H, P, D] for incremental decoding",
    )
    opset: int = opt(18, "--format onnx: ONNX opset (17 or later)")
    quantize: Optional[str] = opt(
        None,
        "--format hf: store the tensors the family's release quantizes as the release does, the others in --dtype "
        "(mxfp4: gpt-oss's experts as MXFP4 uint8 blocks and scales, with the release's quantization_config)",
        choices=list(QUANTIZATIONS),
    )
    hf_class: str = opt(
        "auto",
        "--format hf: transformers class to write (auto: XGLM for sinusoidal positions, OPT for learned ones)",
        choices=list(HF_CLASSES),
    )
    import_from: Optional[str] = opt(
        None,
        "import instead of export: build a toolkit checkpoint folder from a transformers folder (--path): "
        + ", ".join(IMPORTABLE_HF_CLASSES[:-1])
        + f" or {IMPORTABLE_HF_CLASSES[-1]}",
        choices=["hf", "peft"],
        aliases=("--from",),
    )
    base: Optional[str] = opt(
        None,
        "--from peft: the transformers folder the adapter was trained on (default: adapter_config.json's "
        "base_model_name_or_path)",
    )
    tokens_per_sample: Optional[int] = opt(
        None,
        "--from hf: tokens per sample recorded in the checkpoint "
        "(default: GPT-2's n_positions; the Llama family's "
        "max_position_embeddings, at most 2048)",
    )
    log_file: Optional[str] = opt(None, "also write the log to this file")


# toolkit-consolidate (toolkit/export/consolidate.py)


@dataclass
class ConsolidateConfig:
    checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "positional": True,
            "help": "sharded checkpoint folder (e.g. checkpoints/checkpoint_last), or its .pt name "
            "(checkpoints/checkpoint_last.pt)",
        },
    )
    output: Optional[str] = field(
        default=None,
        metadata={"aliases": ("-o",), "help": "file to write (default: the folder's name + .pt, beside it)"},
    )
    no_optimizer: bool = field(
        default=False, metadata={"help": "leave the optimizer state out (a smaller file for evaluation)"}
    )
    force: bool = field(default=False, metadata={"help": "overwrite the output file if it exists"})
    to_fairseq: Optional[str] = field(
        default=None,
        metadata={
            "metavar": "OUT.pt",
            "help": "write the model in fairseq's transformer_lm checkpoint layout to OUT.pt",
        },
    )


# toolkit-eval-harness (toolkit/evaluation/harness_main.py)


@dataclass
class EvalHarnessConfig:
    data: str = opt("", "the data-bin (dictionary and tokenizer; default: the checkpoint's own)", positional=True)
    path: Optional[str] = opt(None, "checkpoint to evaluate (toolkit, fairseq, sharded folder, model.safetensors)")
    tasks: Optional[str] = opt(None, "harness tasks or groups, comma-separated (e.g. hellaswag,arc_easy)")
    num_fewshot: Optional[int] = opt(
        None, "few-shot examples per prompt (default: each task's own)", type=count_or_zero
    )
    batch_size: int = opt(8, "requests per forward pass", type=positive_int)
    limit: Optional[float] = opt(
        None, "evaluate only the first N examples of each task (a fraction if < 1)", type=example_limit
    )
    include_path: Optional[str] = opt(None, "folder of extra harness task YAML files")
    output_path: Optional[str] = opt(None, "write the harness's results JSON here")
    device: Optional[str] = opt(None, "torch device (default: cuda when available, else cpu)")
    cpu_matmul: str = opt("auto", CPU_MATMUL_HELP, choices=CPU_MATMUL_CHOICES)
    context_window: int = opt(
        0,
        "loglikelihood_rolling: more earlier tokens given as context to every "
        "window after the first (0: lm_eval's hf model)",
        type=count_or_zero,
    )
    max_gen_toks: int = opt(256, "generate_until: most tokens generated when a task does not say", type=positive_int)
    seed: int = opt(1234, "random seed (few-shot sampling, generation with sampling)")
    log_samples: bool = opt(False, "keep every request's inputs and outputs in the results JSON")
    apply_chat_template: bool = opt(
        False,
        "render each request's context with the model's chat template (lm_eval --apply_chat_template, its few-shot "
        "examples as turns): the template of the checkpoint's folder, or --chat-template",
    )
    chat_template: Optional[str] = opt(
        None, "--apply-chat-template: a tokenizer folder, tokenizer_config.json or .jinja file with the template"
    )
    fewshot_as_multiturn: str = opt(
        "auto",
        "with --apply-chat-template: the few-shot examples as user/assistant turns (auto: yes, as lm_eval's)",
        choices=["auto", "true", "false"],
    )
    bootstrap_iters: int = opt(
        100000, "bootstrap resamples for the metrics' standard errors (0: none)", type=count_or_zero
    )
    log_file: Optional[str] = opt(None, "also write the log to this file")
