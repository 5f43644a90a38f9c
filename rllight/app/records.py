"""Results as data: one JSON record per measurement, written by the tool that measured it.

A number a reader sees on the results page (``docs/results/index.md``) or in the README's results table comes
from a record under ``docs/results/``; ``tools/results_pages.py`` renders both from the records, and
``tests/tools/test_results.py`` fails where a page disagrees with its records or a record lacks its provenance.

A record is a JSON object with these keys:

- ``id``: its anchor on the results page (``results/index.md#<id>``), also the file's name (``<id>.json``).
- ``title`` (what was measured and under which conditions: no commit or date, which the provenance line gives),
  ``section`` (the results page's heading it sits under), ``question`` (the reader's question it answers, e.g. "How
  much does the quickstart improve the model?": the page groups records by it) and ``note`` (what the numbers are;
  may be empty): text.
- ``superseded_by`` (optional): the id of the record, of the same question, that is now its answer; this one shows
  as an earlier measurement under it. A record no other replaces is a current answer; a question may have several
  (other precisions, other CPUs).
- ``command``: the command that measured it, from the repository root, as a user would type it again.
- ``commit`` (the code it ran, ``abc1234`` or ``abc1234+dirty``), ``date`` (``YYYY-MM-DD``), ``machine`` (the
  line of ``rllight.machine.machine_line``, or what is known of the machine) and ``shared`` (whether other work
  shared the machine, as text): where and when.
- ``source``: ``tool`` (the tool wrote it) or ``transcribed`` (an older number the tool did not record, copied
  with its provenance from ``transcribed_from``; rerunning its command with ``--record`` replaces it).
- ``columns``: ``[[key, label], ...]`` or ``[[key, label, format], ...]`` (a ``str.format`` spec for numbers);
  ``rows``: a list of ``{key: value}``, a value being a number, text or null (shown as an empty cell).
- ``summary`` (optional): ``{key: number}``, e.g. a mean over seeds; ``headline`` (optional): ``{"label": ...,
  "template": ...}``, the README row, its template formatted with ``summary``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys

from rllight.machine import machine_line
from rllight.paths import existing_ancestor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")
SECTIONS = ("Quickstart", "Methods on the quickstart task", "reasoning-gym", "Environments", "Against TRL",
            "Speed and memory", "Asynchronous and stale rollouts")
"""The results page's headings, in order (``tools/results_pages.py``): a tool's ``--section`` is one of them."""
REQUIRED = ("id", "title", "section", "question", "command", "commit", "date", "machine", "shared", "source",
            "columns", "rows")
SOURCES = ("tool", "transcribed")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_DATE = re.compile(r"^\d{4}-\d\d-\d\d$")
_FIGURE = re.compile(r"^[a-z0-9][a-z0-9-]*\.png$")

_QS = "How much does the quickstart improve the model?"
_METHODS = "How do GRPO, DAPO and VAPO compare on the quickstart task?"
_MODEL_REWARD = "Can GRPO learn from a model's reward instead of the exact match?"
_RG = "How much does GRPO improve the model on reasoning-gym tasks?"
_TURNS = "Does the model learn to use feedback and tools over several turns?"
_TRL_SPEED = "Does rllight train as fast as TRL?"
_TRL_LEARNING = "Does rllight learn as much per step as TRL?"
_MEMORY = "How much memory does a run need, phase by phase?"
_STALE = "Which loss trains well on stale rollouts?"
_ASYNC = "How much faster are asynchronous rollouts than synchronous ones?"
QUESTIONS = {
    "quickstart": _QS, "before-after": _QS, "quickstart-memory": _MEMORY, "phase-memory": _MEMORY,
    "install": "How long does installing the quickstart take?",
    "sanity-check": "Does the quickstart recipe pass a learning sanity check?",
    "compare": _METHODS, "vapo-lambda-one": _METHODS,
    "vapo-critic": "Which of VAPO's critic options predicts the return best?",
    "critic-fit": "Which of VAPO's critic options predicts the return best?",
    "critic-probe": ("Does VAPO's critic get better as value pretraining goes on, and does its stopping criterion "
                     "see it?"),
    "distill": "Does on-policy distillation beat GRPO on the quickstart task?",
    "reward-model": _MODEL_REWARD, "judge": _MODEL_REWARD, "model-reward": _MODEL_REWARD,
    "reasoning-gym": _RG, "curriculum": "Does a difficulty curriculum beat uniform sampling on reasoning-gym?",
    "env-feedback": _TURNS, "env-reasoning-gym-feedback": _TURNS,
    "env-textarena": "Can GRPO teach the model a text game?",
    "bench-step": "How long does an RL step take, and where does the time go?",
    "bench-step-trl": _TRL_SPEED, "bench-step-vs-trl": _TRL_SPEED, "bench-step-fixed-length": _TRL_SPEED,
    "bench-step-precision": _TRL_SPEED,
    "bench-step-learning": _TRL_LEARNING, "learning-vs-trl": _TRL_LEARNING, "reasoning-gym-vs-trl": _TRL_LEARNING,
    "bench-gae": "How much faster is the blocked GAE scan than a loop over tokens?",
    "bench-logprobs": "How much memory do chunked log-probs save, and at what cost in time?",
    "bench-rollout": "Is vLLM faster than the HF engine on a CPU?",
    "bench-env-concurrency": "How much does running a slow environment's episodes at once save?",
    "async-staleness": _STALE, "staleness": _STALE, "bench-async": _ASYNC, "bench-step-async": _ASYNC,
}
"""The question a record answers, by the start of its id (the longest that matches, whole words between dashes):
what a tool writes where ``--question`` gives none and its ``--record`` file holds no earlier record."""
SECTION_QUESTIONS = {
    "Quickstart": _QS, "Methods on the quickstart task": "How do the methods compare on the quickstart task?",
    "reasoning-gym": _RG, "Environments": "What does the model learn in an environment?",
    "Against TRL": "How does rllight compare with TRL?",
    "Speed and memory": "How fast is rllight, and how much memory does it need?",
    "Asynchronous and stale rollouts": "How do asynchronous and stale rollouts train?",
}
"""The question of a record whose id ``QUESTIONS`` does not know, by its section."""


def git_commit(root: str = ROOT) -> str:
    """The checked-out commit, ``abc1234``, with ``+dirty`` where tracked files differ from it; ``unknown``
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def tool_command(argv: list[str] | None = None) -> str:
    """This process's command line as the docs write it: ``.venv/bin/python tools/x.py ...`` for a script under
    the repository, the arguments quoted for a shell."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(argv[0])
    if script.startswith(ROOT + os.sep):
        head = [".venv/bin/python", os.path.relpath(script, ROOT)]
    else:
        head = [os.path.basename(argv[0])]
    return shlex.join(head + argv[1:])


def shared_note(shared: bool | None) -> str:
    """``alone`` / ``shared with other work``, or where nobody said, the 1-minute load the machine showed."""
    if shared is not None:
        return "shared with other work" if shared else "alone"
    load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
    return f"not stated (1-minute load {load} on {os.cpu_count()} cores at the end)"


def default_question(*ids: str, section: str) -> str | None:
    """The question of a record with id ``ids[0]``: ``QUESTIONS``' for the longest start of the first id it knows
    (``bench-gae-shared``: ``bench-gae``'s), else the section's (``SECTION_QUESTIONS``)."""
    for id in ids:
        parts = id.split("-")
        for n in range(len(parts), 0, -1):
            if "-".join(parts[:n]) in QUESTIONS:
                return QUESTIONS["-".join(parts[:n])]
    return SECTION_QUESTIONS.get(section)


def make_record(*, id: str, title: str, section: str, columns: list, rows: list[dict], note: str = "",
                summary: dict | None = None, headline: dict | None = None, shared: bool | None = None,
                command: str | None = None, question: str | None = None, figure: str | None = None,
                tables: list | None = None) -> dict:
    """A record of a measurement made now, by this process: its command, commit, date and machine filled in, and
    where ``question`` is None, ``default_question``'s. ``figure``: the name of a PNG the tool drew from the same
    numbers, beside the record in its folder, which the results page shows under the table. ``tables``: for a record
    of many columns, the tables the page shows in place of one, each ``[caption, [column key, ...]]``."""
    record = {
        "id": id, "title": title, "section": section, "question": question or default_question(id, section=section),
        "note": note,
        "command": command or tool_command(), "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine_line().removeprefix("machine: "), "shared": shared_note(shared), "source": "tool",
        "columns": [list(c) for c in columns], "rows": rows,
    }
    if summary:
        record["summary"] = summary
    if headline:
        record["headline"] = headline
    if figure:
        record["figure"] = figure
    if tables:
        record["tables"] = [[caption, list(keys)] for caption, keys in tables]
    check_record(record, f"record {id}")
    return record


def write_record(path: str, record: dict) -> str:
    """Write ``record`` to ``path`` (a ``.json`` file; a folder gets ``<id>.json``) and return the file's path.
    Prints one line naming it."""
    if os.path.isdir(path):
        path = os.path.join(path, f"{record['id']}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"record: {path}")
    return path


# ------------------------------------------------------------------------------------ what the tools call
def add_record_options(parser, *, id: str | None, section: str | None, headline: bool = True) -> None:
    """The options of a measuring tool that writes a record of what it measured: ``--record PATH`` (a ``.json``
    file named after the record's id, or a folder: ``<id>.json`` in it), ``--record-id`` (default: the file's name,
    else ``id``), ``--shared yes|no`` (whether other
    work shared the machine; not given, the record says so and gives the load), ``--section`` (default
    ``section``), ``--question`` (the reader's question it answers; default: that of the record the file holds, else
    ``default_question``), ``--title`` and ``--note`` (replacing the tool's own), and with ``headline``
    ``--headline LABEL`` (a README row with the tool's template). ``id`` or ``section`` None: the tool chooses from
    its mode."""
    group = parser.add_argument_group("record", "Write a record of this measurement for docs/results/ "
                                               "(rllight.app.records).")
    group.add_argument("--record", metavar="PATH",
                       help="Write the record to PATH: a .json file named after the record's id, or a folder "
                            "(<id>.json in it).")
    group.add_argument("--record-id", metavar="ID",
                       help="The record's id: its anchor on the results page and its file's name (default: the "
                            "name of --record's .json file, else "
                            + (f"{id})." if id else "one per mode of the tool)."))
    group.add_argument("--shared", choices=("yes", "no"),
                       help="Whether other work shared the machine while this ran (default: not stated, with the "
                            "load the machine showed).")
    group.add_argument("--section", choices=SECTIONS, default=section,
                       help="The results page's heading the record sits under"
                            + (f" (default {section})." if section else " (default: one per mode of the tool)."))
    group.add_argument("--question", help="The reader's question the record answers, which the results page groups "
                                          "records by (default: that of the record --record's file holds, else "
                                          "the one rllight.app.records.QUESTIONS gives the record's id).")
    group.add_argument("--title", help="The record's title (default: the tool's, naming its settings).")
    group.add_argument("--note", help="What the numbers are, in the record (default: the tool's).")
    if headline:
        group.add_argument("--headline", metavar="LABEL",
                           help="Also a row of the README's results table, labelled LABEL, its value the tool's "
                                "headline of the numbers.")


def _read_record(path: str) -> dict | None:
    """The record ``path`` holds (JSON with a command and rows: a file a rerun may replace), else None."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "command" in data and "rows" in data else None


def check_record_options(parser, args, argv: list[str] | None = None, script: str | None = None) -> None:
    """Refuse (``parser.error``, one line naming the option) a ``--record`` that is neither a folder nor a
    ``.json`` file or whose folder cannot be written, and a ``--record-id`` that is not an id or is not the name of
    ``--record``'s file (a record's file is named after its id): before the measurement, not after it. A
    ``--record`` file gives ``--record-id`` where none is given.

    ``argv`` (the arguments the tool parsed, default ``sys.argv[1:]``) and ``script`` (the tool's file, default
    ``sys.argv[0]``) make the record's command (``args.record_command``, ``tool_command``): the tool's own command
    line also where a test calls its ``main(argv)`` in its own process."""
    args.record_command = tool_command([script or sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    if not args.record:
        return
    is_folder = os.path.isdir(args.record) or args.record.endswith(("/", os.sep))
    if not is_folder and not args.record.endswith(".json"):
        parser.error(f"--record '{args.record}': neither a folder (an existing one, or ending in /) nor a .json file")
    if not is_folder:
        stem = os.path.basename(args.record)[:-len(".json")]
        if args.record_id is not None and args.record_id != stem:
            parser.error(f"--record-id '{args.record_id}' differs from the name of --record's file ({stem}.json): a "
                         "record's file is named after its id")
        if not _ID.match(stem):
            parser.error(f"--record '{args.record}': a record's file is named after its id, which must be "
                         "lower-case letters, digits and dashes")
        args.record_id = stem
        if os.path.exists(args.record) and _read_record(args.record) is None:
            parser.error(f"--record '{args.record}' exists and is not a record: it would be overwritten; name "
                         "another file")
    if args.record_id is not None and not _ID.match(args.record_id):
        parser.error(f"--record-id '{args.record_id}' must be lower-case letters, digits and dashes")
    folder = os.path.abspath(args.record) if is_folder else os.path.dirname(os.path.abspath(args.record))
    existing = existing_ancestor(folder)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        parser.error(f"--record '{args.record}': cannot write under '{existing}'")


def tool_record(args, *, id: str, title: str, section: str, columns: list, rows: list[dict], note: str = "",
                summary: dict | None = None, headline: str | None = None, command: str | None = None,
                figure: str | None = None, tables: list | None = None) -> str | None:
    """Write the record of what a tool measured where ``args.record`` asks for one (else nothing; None): the
    fields given, ``args``' options (``add_record_options``) in place of ``id``, ``title``, ``section``, ``question``
    and ``note`` where given, and with ``args.headline`` a README row whose template is ``headline``. Without
    ``--question``, the question of the record the file held (a rerun answers the question of the record it
    replaces), else ``default_question`` of the record's id, else of the tool's ``id``. Returns its path."""
    if not getattr(args, "record", None):
        return None
    label = getattr(args, "headline", None)
    record_id, section = args.record_id or id, args.section or section
    is_folder = os.path.isdir(args.record) or args.record.endswith(("/", os.sep))
    earlier = _read_record(os.path.join(args.record, f"{record_id}.json") if is_folder else args.record) or {}
    record = make_record(
        id=record_id, title=args.title or title, section=section,
        question=(getattr(args, "question", None) or earlier.get("question")
                  or default_question(record_id, id, section=section)),
        note=note if args.note is None else args.note, columns=columns, rows=rows, summary=summary,
        headline={"label": label, "template": headline} if label and headline else None,
        shared=None if args.shared is None else args.shared == "yes",
        command=command or getattr(args, "record_command", None), figure=figure, tables=tables)
    if args.record.endswith(("/", os.sep)):  # a folder, made where it is not yet
        os.makedirs(args.record, exist_ok=True)
    return write_record(args.record, record)


def parse_value(text: str):
    """A printed value as a record holds it: an int or a float where it reads as a finite one, None for an empty,
    ``-``, ``—`` or non-finite one, else the text."""
    text = text.strip()
    if text in ("", "-", "—"):
        return None
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if kind is int or value == value and abs(value) != float("inf") else None
    return text


def printed(value, spec: str):
    """``value`` as a tool prints it with the format ``spec`` and a record holds it: ``parse_value`` of
    ``format(value, spec)`` (None for None), so that the record and the printout agree to the digit."""
    return None if value is None else parse_value(format(value, spec))


def parse_pairs(line: str) -> dict:
    """``{"a": 1, "b": "x"}`` for a tool's line ``a=1 b=x`` (values through ``parse_value``); ValueError on a
    word that is not ``name=value``."""
    pairs = {}
    for word in line.split():
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise ValueError(f"not a name=value pair: '{word}' in '{line}'")
        pairs[name] = parse_value(value)
    return pairs


def pairs_columns(values: dict, labels: dict[str, str] | None = None, formats: dict[str, str] | None = None) -> list:
    """Columns for the keys of ``values``: ``[key, label]`` (the key where ``labels`` names none), with the format
    ``formats`` gives where it gives one."""
    labels, formats = labels or {}, formats or {}
    return [[k, labels.get(k, k), formats[k]] if k in formats else [k, labels.get(k, k)] for k in values]


def pairs_record(args, line: str, *, id: str, title: str, section: str, settings: dict | None = None,
                 labels: dict[str, str] | None = None, formats: dict[str, str] | None = None, **fields) -> str | None:
    """``tool_record`` of a tool's last line ``a=1 b=x`` as a one-row record: the row the measured settings
    (``settings``, first) and the line's values (``parse_pairs``), the summary the line's numbers (for a
    headline). ``labels`` and ``formats`` (by key) as in ``pairs_columns``; ``fields`` go to ``tool_record``."""
    pairs = parse_pairs(line)
    row = {**(settings or {}), **pairs}
    summary = {k: v for k, v in pairs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return tool_record(args, id=id, title=title, section=section, columns=pairs_columns(row, labels, formats),
                       rows=[row], summary=summary, **fields)


def check_record(record: dict, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` and the field when ``record`` lacks a required field or a field is
    malformed."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    for key in ("command", "commit", "machine", "shared", "title", "section", "question"):
        if not isinstance(record[key], str) or not record[key].strip():
            raise ValueError(f"{where}: '{key}' must be non-empty text")
    if not record["question"].rstrip().endswith("?"):
        raise ValueError(f"{where}: question '{record['question']}' does not end with '?'")
    if not _ID.match(record["id"]):
        raise ValueError(f"{where}: id '{record['id']}' must be lower-case letters, digits and dashes")
    if "superseded_by" in record and (not isinstance(record["superseded_by"], str)
                                      or not _ID.match(record["superseded_by"])
                                      or record["superseded_by"] == record["id"]):
        raise ValueError(f"{where}: superseded_by {record['superseded_by']!r} is not another record's id")
    if "figure" in record and not (isinstance(record["figure"], str) and _FIGURE.match(record["figure"])):
        raise ValueError(f"{where}: figure {record['figure']!r} is not the name of a .png file beside the record")
    if not _DATE.match(record["date"]):
        raise ValueError(f"{where}: date '{record['date']}' is not YYYY-MM-DD")
    if record["source"] not in SOURCES:
        raise ValueError(f"{where}: source '{record['source']}' is not one of {', '.join(SOURCES)}")
    if record["source"] == "transcribed" and not record.get("transcribed_from"):
        raise ValueError(f"{where}: a transcribed record names where it was copied from in 'transcribed_from'")
    keys = []
    for column in record["columns"]:
        if not isinstance(column, list) or len(column) not in (2, 3):
            raise ValueError(f"{where}: column {column!r} is not [key, label] or [key, label, format]")
        keys.append(column[0])
    for table in record.get("tables", []):
        if not (isinstance(table, list) and len(table) == 2 and isinstance(table[0], str) and table[1]):
            raise ValueError(f"{where}: table {table!r} is not [caption, [column key, ...]]")
        unknown = [k for k in table[1] if k not in keys]
        if unknown:
            raise ValueError(f"{where}: table '{table[0]}' names no column {', '.join(map(str, unknown))}")
    for i, row in enumerate(record["rows"]):
        unknown = set(row) - set(keys)
        if unknown:
            raise ValueError(f"{where}: row {i + 1} has values for no column: {', '.join(sorted(unknown))}")
    if "headline" in record:
        try:
            headline_value(record)
        except (KeyError, ValueError, IndexError) as e:
            raise ValueError(f"{where}: headline template does not format with the summary: {e}") from None


def headline_value(record: dict) -> str:
    """The README's value for ``record``: its headline template formatted with its summary."""
    return record["headline"]["template"].format(**record.get("summary", {}))


def cell(value, fmt: str | None = None) -> str:
    """One table cell: empty for null, a number through ``fmt`` where given."""
    if value is None:
        return ""
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        if value == 0:
            fmt = fmt.lstrip("+")  # 0.00, not +0.00
        return format(value, fmt).replace("-", "\u2212", 1)  # a minus sign, not a hyphen
    return str(value).replace("|", "\\|")


def load_records(folder: str = RESULTS_DIR) -> list[dict]:
    """Every ``*.json`` record in ``folder``, checked (alone, then against the others: ``check_records``), sorted by
    id (a record before those whose ids extend it)."""
    records = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        with open(path) as f:
            try:
                record = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        check_record(record, path)
        if name != f"{record['id']}.json":
            raise ValueError(f"{path}: a record's file is named after its id ({record['id']}.json)")
        if "figure" in record and not os.path.isfile(os.path.join(folder, record["figure"])):
            raise ValueError(f"{path}: its figure {record['figure']} is not in {folder}: draw it again with the "
                             "record's command")
        records.append(record)
    check_records(records, folder)
    return sorted(records, key=lambda r: r["id"])


def check_records(records: list[dict], folder: str) -> None:
    """Raise ``ValueError`` naming the file where a record's ``superseded_by`` names no record of ``records``, one of
    another question or one itself superseded, or where a question's records sit under different sections."""
    by_id = {r["id"]: r for r in records}
    sections = {}
    for record in records:
        path = os.path.join(folder, f"{record['id']}.json")
        later = record.get("superseded_by")
        if later is not None:
            if later not in by_id:
                raise ValueError(f"{path}: superseded_by '{later}' names no record in {folder}")
            if by_id[later]["question"] != record["question"]:
                raise ValueError(f"{path}: superseded_by '{later}', a record of another question "
                                 f"('{by_id[later]['question']}')")
            if "superseded_by" in by_id[later]:
                raise ValueError(f"{path}: superseded_by '{later}', which is itself superseded by "
                                 f"'{by_id[later]['superseded_by']}': name the current record")
        first = sections.setdefault(record["question"], record)
        if first["section"] != record["section"]:
            raise ValueError(f"{path}: question '{record['question']}' sits under section '{first['section']}' in "
                             f"{first['id']}.json, not '{record['section']}'")


__all__ = ["QUESTIONS", "RESULTS_DIR", "SECTIONS", "SECTION_QUESTIONS", "add_record_options", "check_record",
           "check_record_options", "check_records", "default_question", "git_commit", "headline_value", "load_records",
           "make_record", "pairs_columns", "pairs_record", "parse_pairs", "parse_value", "printed", "shared_note",
           "tool_command", "tool_record", "write_record"]
