"""The ``rllight`` command line around its parse: the parser (``trainer.precision: auto`` resolved while parsing),
the help texts of ``fit`` and of the commands not offered, what is read from the arguments before the parse (every
``--config`` file checked, the ``--ckpt_path`` given) and jsonargparse's errors condensed into one line.
``rllight.app.cli`` runs the command."""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import os
import re
import typing
from collections import abc
from typing import Literal, Union

from lightning.pytorch.cli import LightningArgumentParser

from rllight.bounds import bound_of
from rllight.envs.factory import system_module
from rllight.errors import RecipeError
from rllight.precision import resolve_config


FIT_DESCRIPTION = (
    "Train with a recipe: rllight fit --config recipes/grpo.yaml [--config overlay.yaml] [--key value ...]. "
    "Rollout callbacks go in trainer.callbacks (class_path + init_args): rllight.callbacks.OverlongFilter, "
    "rllight.callbacks.SoftOverlongPunishment, rllight.callbacks.SelfImitation, "
    "rllight.callbacks.ValuePretraining (see recipes/dapo.yaml and recipes/vapo.yaml). "
    "A checkpoint (last.ckpt) is saved every 10 RL steps (rollouts) and at the end (--checkpoint.every_n_steps; "
    "--checkpoint.keep N "
    "keeps the newest N; --checkpoint.final_weights_only true saves the last without the optimizer state) unless "
    "the recipe configures a ModelCheckpoint or sets trainer.enable_checkpointing: false; "
    "Ctrl-C or SIGTERM saves one after the current step and prints the "
    "command that resumes (--ckpt_path FILE)."
)


class RecipeParser(LightningArgumentParser):
    """Lightning's parser, with ``trainer.precision: auto`` and the engine's ``dtype: auto`` resolved as part of
    parsing, before ``--print_config`` prints (jsonargparse prints inside ``_parse_common``, the one step every
    parse goes through: ``tests/test_precision.py`` checks the printed value, so a jsonargparse that renames
    it fails there)."""

    def _parse_common(self, cfg, env, defaults, skip_validation, *args, **kwargs):
        # The whole command line's parse, not that of one --config file inside it (defaults off, no validation):
        # a later --trainer.precision must still win over a file's auto.
        if defaults and not skip_validation:
            for prefix in ("", "fit.", "validate."):
                if cfg.get(prefix + "trainer") is not None:
                    resolve_config(cfg.get(prefix[:-1]) if prefix else cfg)
        return super()._parse_common(cfg, env, defaults, skip_validation, *args, **kwargs)

    def allow_auto_precision(self) -> None:
        """Let ``trainer.precision`` take ``auto`` (Lightning's type lists its own values only)."""
        for action in self._actions:
            if action.dest == "trainer.precision" and hasattr(action, "_typehint"):
                action._typehint = Union[Literal["auto"], action._typehint]


SPECIAL_CKPT = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` values that Lightning resolves itself (not files)."""


def ckpt_path_given(argv: list[str]) -> str | None:
    """The ``--ckpt_path`` given on the command line (the last one wins, as in the parser)."""
    found = None
    for a, b in zip(argv, argv[1:] + [None]):
        if a == "--ckpt_path":
            found = b
        elif a.startswith("--ckpt_path="):
            found = a.split("=", 1)[1]
    return found


TRAINING_ONLY = ("--trainer.max_steps", "--evaluate_before_after", "--evaluate_before_again", "--resume_allow_changes")
"""Options that act on a fit alone: a printed ``rllight validate`` command leaves them out."""


def without_options(words: list[str], extra) -> list[str]:
    """``words`` (a command line) without the options that ``extra`` sets (``--option value`` or ``--option=value``),
    so that a printed command's own value replaces the run's rather than repeating it."""
    for option in (e for e in extra if e.startswith("--")):
        kept = []
        for word in words:
            if kept and kept[-1] == option:
                kept.pop()  # "--option value": the value goes with it
            elif not word.startswith(option + "="):
                kept.append(word)
        words = kept
    return words


_DETAIL_HINTS = ("is not accepted", "not expected", "Unrecognized", "Expected a", "does not exist", "No module",
                 "not a subclass", "Import path", "Not a valid", "missing")
_KEY_LINE = re.compile(r'Parser key "([^"]+)":$')
_CLASS_LINE = re.compile(r"^Problem with given class_path '([^']+)':$")
_BOOKKEEPING = ("Subtypes:", "Given value type:", "Given value:",
                "Does not validate against any of the Union subtypes")
_STRING_FOR_CLASS = ("Expected a path but", "Expected a dot import path string")


class _Line:
    """One line of jsonargparse's error, with the lines indented under it."""

    def __init__(self, text: str, column: int):
        self.text, self.column, self.children = text, column, []

    def child(self, prefix: str) -> str | None:
        """The text after ``prefix`` of the first line under this one that starts with it."""
        return next((c.text[len(prefix):] for c in self.children if c.text.startswith(prefix)), None)


def _tree(message: str) -> _Line:
    """jsonargparse's nested error as a tree of lines by indentation (an alternative's ``- `` marks its column)."""
    root = _Line("", -1)
    stack = [root]
    for raw in message.splitlines():
        text = raw.strip()
        if not text:
            continue
        column = len(raw) - len(raw.lstrip(" "))
        if text.startswith("- "):
            text, column = text[2:].strip(), column + 2
        while stack[-1].column >= column:
            stack.pop()
        line = _Line(text, column)
        stack[-1].children.append(line)
        stack.append(line)
    return root


def _causes(line: _Line, path: tuple = ()):
    """Every cause the error lists, as ``(path, line)``: ``path`` holds the ``("key", name, line)`` and ``("class",
    class_path, line)`` steps down to the cause, through the alternatives of every union."""
    found = _KEY_LINE.search(line.text)
    if found:
        path = (*path, ("key", found.group(1), line))
    elif _CLASS_LINE.match(line.text):
        path = (*path, ("class", _CLASS_LINE.match(line.text).group(1), line))
    elif line.text.startswith(("Subclass types expect one of", *_BOOKKEEPING)):
        return
    elif not line.children and line.text:
        yield path, line
        return
    for child in line.children:
        yield from _causes(child, path)


def _rank(cause) -> tuple[int, int]:
    """Deepest first; a string tried as a class, or the generic refusal of a list item, only where nothing else."""
    path, line = cause
    vague = line.text.startswith((*_STRING_FOR_CLASS, "Not a valid subclass of"))
    return len(path), 0 if vague else 1


def _import(path: str):
    """The class at ``path`` (jsonargparse imported it already), or None."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _container(owner: str | None, name: str, subtypes: str | None) -> str | None:
    """``"dict"`` or ``"list"`` where the setting ``name`` of class ``owner`` (or, at the top, the union's
    ``subtypes``) holds several classes, else None."""
    if subtypes and subtypes.startswith(("[dict[", "[list[")):
        return subtypes[1:5]
    cls = _import(owner) if owner else None
    try:
        hint = typing.get_type_hints(cls.__init__).get(name) if cls is not None else None
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: not a container
        return None
    for kind in (hint, *typing.get_args(hint)):
        origin = typing.get_origin(kind)
        if origin in (dict, abc.Mapping, abc.MutableMapping):
            return "dict"
        if origin in (list, tuple, abc.Sequence):
            return "list"
    return None


def _literal(text: str | None):
    """The plain value jsonargparse printed (``Namespace(...)`` a dict, ``NestedArg(key=k, val=v)`` the nested
    dict it stands for); None where it is not one. Read with ``ast``, never evaluated."""
    if text is None:
        return None

    def plain(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -plain(node.operand)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [plain(n) for n in node.elts]
        if isinstance(node, ast.Dict):
            return {plain(k): plain(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            fields = {k.arg: plain(k.value) for k in node.keywords}
            if node.func.id == "NestedArg" and isinstance(fields.get("key"), str):
                out = fields.get("val")
                for part in reversed(fields["key"].split(".")):
                    out = {part: out}
                return {"init_args": out}
            return fields
        raise ValueError(node)

    try:
        return plain(ast.parse(text.split(". Got value:")[0], mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


def _given(shown: str):
    """The value a union's ``Given value:`` line shows: plain data as such, a bare word (a value from the command
    line, e.g. ``fast``) as text; None for a structure that does not read back."""
    value = _literal(shown)
    word = shown.split(". Got value:")[0].strip()
    if value is None and word and not re.search(r"[({\[<]", word):
        return word
    return value


def _dig(value, name: str):
    """``value[name]`` for a dotted ``name``, through a class's ``init_args``; None where absent."""
    for part in name.split("."):
        if isinstance(value, dict) and part not in value and isinstance(value.get("init_args"), dict):
            value = value["init_args"]
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _entry(entries, class_path: str, then: str | None) -> str | None:
    """The name in the dict ``entries`` (as given) of the item of class ``class_path`` whose setting ``then``
    failed; None where the given value does not tell."""
    if not isinstance(entries, dict):
        return None
    short = class_path.rsplit(".", 1)[-1]
    named = [(name, spec) for name, spec in entries.items() if isinstance(spec, dict)
             and str(spec.get("class_path", short)).rsplit(".", 1)[-1] == short]
    if then is not None:
        named = [(n, s) for n, s in named if _dig(s, then.split(".")[0]) is not None] or named
    return str(named[0][0]) if named else None


def _located(path: tuple) -> tuple[str, str, object]:
    """The full key of a cause's ``path``: its keys joined through each class's ``init_args``, an item of a dict of
    classes by its name (``model.reward.init_args.rewards.judge.init_args.scale``), an item of a list by its class
    (``trainer.callbacks: TeacherLogprobs.micro_batch_size``). Returns ``(key, sep, given)``: what comes after the
    last class's name, and the value given there (or None)."""
    key, sep, given, owner, subtypes = "", ".", None, None, None
    for index, (kind, name, line) in enumerate(path):
        if kind == "key":
            key = f"{key}{sep}{name}" if key else name
            sep, subtypes = ".init_args.", line.child("Subtypes: ")
            shown = line.child("Given value: ")
            given = _given(shown) if shown is not None else _dig(given, name)
            continue
        then = next((n for k, n, _ in path[index + 1:] if k == "key"), None)
        after_key = index > 0 and path[index - 1][0] == "key"
        container = _container(owner, key.rsplit(".", 1)[-1], subtypes) if after_key else None
        entry = _entry(given, name, then) if container == "dict" else None
        if entry is not None:
            key, given = f"{key}.{entry}", given.get(entry)
        elif container is not None:
            key, given = f"{key}: {name.rsplit('.', 1)[-1]}", None
        sep, owner = ("." if container is not None and entry is None else ".init_args."), name
    return key, sep, given


def _shown(value) -> str:
    """A value as a message quotes it: text in quotes, anything else as written."""
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)


def _got(line: _Line, given) -> str:
    """``, got <value>`` for a cause, from its own ``Got value`` or the value given at its key."""
    found = re.search(r"Got value: (.*)$", line.text)
    if found:
        value = _literal(found.group(1))
        return f", got {_shown(found.group(1) if value is None else value)}"
    return "" if given is None or isinstance(given, dict) else f", got {_shown(given)}"


def _explained(path: tuple, line: _Line) -> str | None:
    """One line for the cause ``line`` at ``path``: the full key, what is wrong and what to give instead."""
    key, sep, given = _located(path)
    text = line.text
    last = path[-1] if path else None
    cls_path = last[1] if last and last[0] == "class" else None
    short = cls_path.rsplit(".", 1)[-1] if cls_path else None
    if cls_path and (found := re.match(r"Option '([^']+)' is not accepted", text)):
        return _unknown_option(f"{key}{sep}{found.group(1)}", found.group(1), cls_path)
    if cls_path and (found := re.match(r"the following arguments are required: (.+)", text)):
        names = [n.strip() for n in found.group(1).split(",")]
        return f"{key}{sep}{names[0]} is required: {short} has no default for it; give one"
    if (found := re.match(r"Not of type (\w+): got (.*)", text)):
        bound = bound_of(found.group(1)) or f"of type {found.group(1)}"
        return f"{key} must be {bound}, got {found.group(2)}"
    if (found := re.match(r"Expected a typing\.Literal\[(.*)\]", text)):
        allowed = _literal(f"[{found.group(1)}]") or [found.group(1)]
        return f"{key} must be one of {', '.join(map(str, allowed))}{_got(line, given)}"
    found = re.match(r"Import path (\S+) does not (?:correspond to a subclass of|implement protocol) (\w+)", text)
    found = found or re.search(r"Expected '([\w.]+)' to be a subclass of <class '(\w+)'>", text)
    if found:
        entry = _entry(given, found.group(1), None) if isinstance(given, dict) and "class_path" not in given else None
        key = f"{key}.{entry}" if entry is not None else key
        return f"{key}: {found.group(1)} is not a subclass of {found.group(2)}; give the class_path of one"
    if cls_path:  # the class itself could not be used: it does not import, or its constructor is not readable
        return f"{key}: class_path '{cls_path}' cannot be used ({text}); give the import path of a class"
    if text.startswith(_STRING_FOR_CLASS):
        expected = _expected(path)
        wanted = f"a {expected} (class_path and init_args, or a class path)" if expected else "a class path"
        value = re.search(r"(?:but | string: )(.*?)(?: either not accessible or invalid)?$", text)
        return f"{key} expects {wanted}, got {_shown(value.group(1) if value else given)}"
    if (found := re.match(r"Expected a <class '(\w+)'>", text)) and found.group(1) != "NoneType":
        expected = _expected(path, generic=True)  # a container's type: the whole value given, not its item
        got = f", got {_shown(given)}" if expected and given is not None else _got(line, given)
        return f"{key} expects a {expected or found.group(1)}{got}"
    if text.startswith("Not a valid subclass of"):
        return f"{key}: {text}; give class_path and init_args"
    return f"{key}: {text.split('. Got value:')[0]}"


def _expected(path: tuple, generic: bool = False) -> str | None:
    """The type the last key of ``path`` takes, as its union lists it (None left out): a class's name, or with
    ``generic`` a container's type (``dict[str, float]``); None where the union does not say."""
    keys = [line for kind, _, line in path if kind == "key"]
    subtypes = keys[-1].child("Subtypes: ") if keys else None
    if not subtypes:
        return None if generic else _annotated(path)
    names = [n.strip() for n in re.split(r",(?![^\[]*\])", subtypes.strip("[]")) if "NoneType" not in n]
    names = [re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", n) for n in names]
    if not names or (not generic and "[" in names[0]) or (generic and "[" not in names[0]):
        return None
    return names[0]


def _annotated(path: tuple) -> str | None:
    """The name of the class that the last key of ``path`` takes, from its owner's annotation; None where unknown."""
    owner = next((name for kind, name, _ in reversed(path) if kind == "class"), None)
    name = path[-1][1] if path and path[-1][0] == "key" else None
    try:
        hint = typing.get_type_hints(_import(owner).__init__).get(name) if owner and name else None
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here
        return None
    kinds = [k for k in (hint, *typing.get_args(hint)) if isinstance(k, type) and k is not type(None)]
    return kinds[0].__name__ if kinds else None


def _unknown_option(key: str, option: str, class_path: str) -> str:
    """``<key>: <Class> has no option '<option>'`` with the closest one and every option it takes."""
    cls = _import(class_path)
    short = class_path.rsplit(".", 1)[-1]
    try:
        names = [p.name for p in inspect.signature(cls).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)] if cls is not None else []
    except (TypeError, ValueError):
        names = []
    close = difflib.get_close_matches(option, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    takes = f"; it takes {', '.join(names)}" if names else ""
    return f"{key}: {short} has no option '{option}'{hint}{takes}"


def _deepest_cause(message: str) -> str | None:
    """jsonargparse's error as one line naming the full key of its real cause, the deepest one it lists (a union's
    other alternatives, such as ``Expected a <class 'NoneType'>``, are not causes); None where it lists none."""
    causes = [c for c in _causes(_tree(message)) if c[0] and "<class 'NoneType'>" not in c[1].text]
    if not causes:
        return None
    best = max(range(len(causes)), key=lambda i: (_rank(causes[i]), -i))
    return _explained(*causes[best])


def one_line_parse_error(message: str) -> str:
    """Condense jsonargparse's nested, multi-line error into one line naming the full key, the problem and what to
    give instead (``(see: rllight fit --help)`` for the options)."""
    lines = [line.strip(" -") for line in str(message).splitlines() if line.strip(" -")]
    if not lines:
        return "invalid recipe"
    explained = _deepest_cause(str(message))
    if explained is not None:
        return f"{explained} (see: rllight fit --help)"
    head = lines[0].rstrip(":")
    index = next((i for hint in _DETAIL_HINTS for i, line in enumerate(lines) if i and hint in line),
                 1 if len(lines) > 1 else None)
    detail = ""
    if index is not None:
        detail = lines[index]
        if detail.endswith(":") and index + 1 < len(lines):  # "Problem with given class_path 'x':" + cause
            detail = f"{detail} {lines[index + 1]}"
    text = f"{head}: {detail}" if detail else head
    return f"{text} (see: rllight fit --help)"


def _class_nodes(value, where: str, listed: bool = False):
    """``(prefix, class_path, init_args)`` of every class in the plain recipe ``value`` (at key ``where``):
    ``prefix`` is the key of its settings (``model.reward.init_args.rewards.judge.init_args``; an item of a list by
    its class, ``trainer.callbacks: TeacherLogprobs``)."""
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        prefix = where if listed else f"{where}.init_args"
        yield prefix, value["class_path"], value.get("init_args") or {}
        for name, inner in (value.get("init_args") or {}).items():
            yield from _class_nodes(inner, f"{prefix}.{name}")
    elif isinstance(value, dict):
        for name, inner in value.items():
            yield from _class_nodes(inner, f"{where}.{name}" if where else str(name))
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("class_path"), str):
                yield from _class_nodes(item, f"{where}: {item['class_path'].rsplit('.', 1)[-1]}", listed=True)


def check_class_paths(recipe: dict) -> None:
    """Every ``class_path`` in ``recipe`` (plain values) names a class outside Python's standard library, or a
    one-line ``RecipeError`` naming its key, before anything is constructed: where a setting takes a callable
    (``model.optimizer``), jsonargparse calls what a ``class_path`` names with its ``init_args``, a function such as
    ``os.system`` included (docs/guides/security.md)."""
    for prefix, class_path, _ in _class_nodes(recipe, ""):
        found = _import(class_path)
        if found is None:
            continue
        module = getattr(found, "__module__", None) or "builtins"
        what = None if inspect.isclass(found) else f"a {type(found).__name__}, not a class"
        what = what or (f"a class of Python's standard library ({module})" if system_module(module) else None)
        if what:
            where = prefix[:-len(".init_args")] if prefix.endswith(".init_args") else prefix
            raise RecipeError(f"{where}.class_path: {class_path!r} is {what}, which a recipe may not construct; name a "
                              "class of rllight, of an installed package or of your own (docs/guides/security.md)")


def _settings_key(obj, settings: dict, recipe: dict) -> str | None:
    """Where in ``recipe`` the object ``obj`` was built: the prefix of the class of its type whose plain settings
    agree most with ``settings`` (its constructor's arguments, or its attributes)."""
    best, found = -1, None
    for prefix, class_path, init_args in _class_nodes(recipe, ""):
        if _import(class_path) is not type(obj):
            continue
        score = sum(1 for name, value in init_args.items()
                    if isinstance(value, (str, int, float, bool, type(None))) and settings.get(name) == value)
        if score > best:
            best, found = score, prefix
    return found


def relocate(err: BaseException | None, recipe: dict | None) -> None:
    """Make ``err``, a ``RecipeError`` of a class of the recipe that names its setting from where the class usually
    sits (its module's ``KEY``, e.g. ``model.reward.init_args``), name it from where the class sits in ``recipe``
    (``model.reward.init_args.rewards.judge.init_args`` for a judge inside ``rllight.rewards.Weighted``). The
    innermost constructor or method in the traceback whose module has such a ``KEY`` and whose message starts with
    it says which object raised."""
    if err is None or not recipe or not err.args or not isinstance(err.args[0], str):
        return
    text, frames, tb = err.args[0], [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        key, obj = frame.f_globals.get("KEY"), frame.f_locals.get("self")
        if obj is None or not isinstance(key, str) or not re.fullmatch(r"[\w.]+\.init_args", key):
            continue
        if text.startswith(key) and text[len(key):len(key) + 1] in ("", ".", ":", " "):
            settings = frame.f_locals if frame.f_code.co_name == "__init__" else getattr(obj, "__dict__", {})
            where = _settings_key(obj, settings, recipe)
            if where and where != key:
                err.args = (where + text[len(key):], *err.args[1:])
            return


NOT_OFFERED = {
    "test": "rllight test is not offered: evaluate on other data with rllight validate --config R.yaml "
            "--data.val_files '[FILE]' (add --model.path DIR for a trained model folder)",
    "predict": "rllight predict is not offered: write generations for a file of prompts with rllight generate "
               "--model.path DIR --prompts FILE --output out.jsonl",
}
