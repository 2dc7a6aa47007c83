"""Prompt sources for evaluation: a built-in set, or a local json / jsonl / txt file read with `datasets`.

The file helpers (`read_prompt_table`, `find_column`, `column_texts`) are shared with `drafter-datagen`, which
also reads parquet; their errors name the config section (``eval.`` or ``datagen.``) the bad value came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from drafter_train.config import PROMPTS_DIR
from drafter_train.errors import ConfigError

if TYPE_CHECKING:
    import datasets

# Short and varied on purpose: acceptance rates differ between free-form stories, factual answers and code, and an
# evaluation over one kind of prompt would flatter or punish a drafter.
DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue in simple terms.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for staying focused while studying.",
    "Once upon a time, in a village at the edge of a great forest,",
    "Summarise the water cycle in a few sentences.",
    "What are the main causes of the seasons on Earth?",
    "Write a haiku about autumn leaves.",
    "How do I reverse a linked list? Explain the idea, then show code.",
    "Describe how a bicycle works to a ten-year-old.",
    "What is photosynthesis and why is it important?",
    "Write a polite email asking a colleague to review a document by Friday.",
    "List five healthy breakfast ideas.",
    "Explain the difference between weather and climate.",
    "Write a SQL query that returns the ten most recent orders from a table named orders.",
    "The old robot woke up in an empty warehouse and",
    "Why do cats purr?",
    "Explain what a hash table is and when you would use one.",
    "Write a limerick about a forgetful wizard.",
    "What should I pack for a three-day hiking trip?",
    "Explain recursion with a simple example.",
    "How does a vaccine help the body fight disease?",
    "Write a JavaScript function that removes duplicates from an array.",
    "Give a short history of the printing press.",
    "What is the Pythagorean theorem? Give an example.",
    "Write a dialogue between a detective and a nervous witness.",
    "Suggest a name for a small coffee shop and explain your choice.",
    "How do airplanes stay in the air?",
    "Explain what an API is to someone who does not program.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What are the benefits of regular exercise?",
    "Describe a sunset over the ocean in vivid detail.",
    "What is the difference between RAM and storage?",
    "Write a short poem about friendship.",
    "How do I make a simple tomato sauce?",
    "Explain the rules of chess in a few sentences.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Why is it important to get enough sleep?",
    "Write a function in C that returns the maximum of an array of integers.",
]

# File suffix -> `datasets` builder. Evaluation reads the text formats; datagen also reads parquet.
BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
_SUFFIXES = (".json", ".jsonl", ".txt")
# Column names tried in order when the user names none (common in instruction and prompt datasets).
TEXT_COLUMNS = ("prompt", "text", "instruction", "question")
# Optional column naming each prompt's task category (chat, code, ...): the evaluator reports per category.
CATEGORY_COLUMN = "category"
# The shipped splits (drafter_train/prompts/README.md): dev chooses recipes, decoders and `best`; test only reports.
DEV, TEST = "dev", "test"
# Older names of shipped sets, kept so earlier commands still run: heldout-mix was the dev split's first name.
ALIASES = {"heldout-mix": DEV}


def load_prompts(path: Optional[str], num_prompts: int, field: Optional[str] = None) -> list[str]:
    """The first ``num_prompts`` prompts (all of them if fewer exist; the caller reports the count).

    ``path`` None gives the built-in set. Otherwise a local .json / .jsonl file (records, or a plain list of
    strings) whose text column is ``field`` or the first of prompt/text/instruction/question, or a .txt file with
    one prompt per non-empty line.
    """
    return [text for text, _ in load_prompt_records(path, num_prompts, field)]


def load_prompt_records(path: Optional[str], num_prompts: int, field: Optional[str] = None
                        ) -> list[tuple[str, Optional[str]]]:
    """As `load_prompts`, with each prompt's task category: the file's `category` column when it has one, else None
    (the built-in set has none)."""
    if path is None:
        return [(text, None) for text in DEFAULT_PROMPTS[:num_prompts]]
    rows = read_prompt_table(path, "eval", _SUFFIXES)
    column = find_column(rows.column_names, field, TEXT_COLUMNS, path, "eval", "prompt_field")
    texts = column_texts(rows, column, path, "eval", "prompt_field")
    categories = rows[CATEGORY_COLUMN] if CATEGORY_COLUMN in rows.column_names else [None] * len(texts)
    records = [(text, category) for text, category in zip(texts, categories) if text]
    if not records:
        raise ConfigError(f"eval.prompts: no prompts in {path}")
    return records[:num_prompts]


def read_prompt_table(path: str, section: str, suffixes: Sequence[str] = tuple(BUILDERS)) -> datasets.Dataset:
    """A local prompt file as a `datasets.Dataset`; errors are one line starting with ``{section}.prompts``."""
    file = _check_file(path, section, suffixes)
    return _read(file, section)


def shipped_prompts(path: str) -> Optional[Path]:
    """The package's own prompt set `path` names (`dev`, `dev.jsonl` or `prompts/dev.jsonl`; `heldout-mix` is the
    dev split's old name) when no such local file exists; None otherwise. Shipped sets travel inside the package
    (package data), so a command names them the same way from a checkout, a wheel or any working directory."""
    if Path(path).expanduser().exists():
        return None
    name = Path(path).name
    name = ALIASES.get(Path(name).stem, Path(name).stem) + Path(name).suffix
    for candidate in (PROMPTS_DIR / name, PROMPTS_DIR / f"{name}.jsonl"):
        if candidate.is_file() and (Path(path).parent in (Path("."), Path("prompts"))):
            return candidate
    return None


def split_name(path: Optional[str]) -> str:
    """How results name the prompts they ran on: `dev` or `test` for the shipped splits (whatever name or path
    reached them), `builtin` for the built-in set, else the path as given."""
    if path is None:
        return "builtin"
    file = (shipped_prompts(path) or Path(path).expanduser()).resolve()
    for split in (DEV, TEST):
        if file == (PROMPTS_DIR / f"{split}.jsonl").resolve():
            return split
    return path


def refuse_test_split(path: Optional[str], option: str, chooser: str) -> None:
    """Anything that chooses (calibration, `best`, the layer-skip search's confirmation) must never read the test
    split: figures reported on it would then be tuned to it. One line naming the option."""
    if path is not None and split_name(path) == TEST:
        raise ConfigError(f"{option}: {chooser} chooses, and the test split only reports; choose on {option}={DEV} "
                          "and evaluate the choice on test with drafter-eval")


def check_prompt_file(path: str, section: str) -> None:
    """The checks reading `path` as a prompt file makes, without reading it (one line naming `section`.prompts)."""
    _check_file(path, section, tuple(BUILDERS))


def _check_file(path: str, section: str, suffixes: Sequence[str]) -> Path:
    file = shipped_prompts(path) or Path(path).expanduser()
    if not file.is_file():
        reason = "not a file" if file.exists() else "no such file"
        raise ConfigError(f"{section}.prompts: {reason}: {path}")
    if file.suffix.lower() not in suffixes:
        raise ConfigError(
            f"{section}.prompts: unsupported file type {file.suffix or '(none)'!r}, use one of {tuple(suffixes)}"
        )
    if file.stat().st_size == 0:
        # datasets fails on empty files with an unhelpful StopIteration / generation error.
        raise ConfigError(f"{section}.prompts: {path} is empty")
    return file


def _read(file: Path, section: str) -> datasets.Dataset:
    # datasets reads a JSON list of strings as one "text" column, so no special case is needed for it.
    import datasets  # here, not with the module: the console scripts check prompt paths before datasets loads

    builder = BUILDERS[file.suffix.lower()]
    try:
        return datasets.load_dataset(builder, data_files=str(file), split="train")
    except (datasets.exceptions.DatasetsError, ValueError, StopIteration, OSError) as err:
        cause = err.__cause__ or err
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(f"{section}.prompts: could not read {file} as {builder}: {reason}") from err


def find_column(
    columns: Sequence[str],
    field: Optional[str],
    candidates: Sequence[str],
    path: str,
    section: str,
    field_key: str,
    required: bool = True,
) -> Optional[str]:
    """``field`` if given (it must exist), else the first of ``candidates`` present; None only if not required."""
    if field is not None:
        if field not in columns:
            raise ConfigError(
                f"{section}.{field_key}: {path} has no column {field!r} (columns: {', '.join(columns)})"
            )
        return field
    for name in candidates:
        if name in columns:
            return name
    if not required:
        return None
    raise ConfigError(
        f"{section}.prompts: {path} has none of the columns {', '.join(candidates)} "
        f"(columns: {', '.join(columns)}); name one with {section}.{field_key}"
    )


def column_texts(rows: datasets.Dataset, column: str, path: str, section: str, field_key: str) -> list[str]:
    """The column's values stripped; "" for missing values (blank lines, nulls), which callers drop."""
    return [_as_text(value, column, path, section, field_key) for value in rows[column]]


def _as_text(value: object, column: str, path: str, section: str, field_key: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(
            f"{section}.{field_key}: column {column!r} of {path} holds {type(value).__name__}, not text"
        )
    return value.strip()


def prompt_ids(tokenizer, target_cfg, prompts: Optional[str], num_prompts: int,
               categories: Optional[Sequence[str]] = None) -> tuple[list[list[int]], list]:
    """The first `num_prompts` prompts of `prompts` (of those in `categories`, when given) as token ids (chat
    template as the target config says), and their task categories."""
    from drafter_train.targets import encode_prompt

    records = load_prompt_records(prompts, num_prompts if not categories else 10 ** 9)
    if categories:
        records = [r for r in records if r[1] in set(categories)][:num_prompts]
        if not records:
            raise ConfigError(f"prompt categories {','.join(categories)}: no such prompts in {prompts}")
    return ([encode_prompt(tokenizer, text, target_cfg.chat_template) for text, _ in records],
            [category for _, category in records])
