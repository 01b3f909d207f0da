"""The evaluation's prompts: each asks for something stored far back, and :func:`retrieved` tells
whether a target's output gives it.

- :func:`code_prompt`: a window of held-out code (the ``code`` task);
- :func:`retrieval_prompt`: a key-value document ending with a key stored far back (the toy pair's
  ``retrieval``);
- :func:`planted_retrieval_prompt`: held-out code with one planted ``SECRET_... = "value"`` line, the
  real drafter's training format with words of :data:`PLANT_WORDS` (the real pair's ``retrieval``);
- :data:`HELD_OUT_FORMS`: retrieval prompts of forms and lexicons no training form contains, for
  ``fold-demo --real`` (a support e-mail thread, meeting minutes).
"""

from __future__ import annotations

import datetime
import random
from collections import Counter

from fold.demo.documents import kv_line
from fold.demo.tokens import encode, fast_tokenizer

def retrieval_prompt(rng: random.Random, tokenizer, length: int, min_distance: int) -> tuple[list[int], list[int]]:
    """A key-value document of ``length`` tokens with no repeated key, ending with ``"<key>:"`` for a
    key stored at least ``min_distance`` tokens before the end -> ``(prompt ids, answer ids)``: the
    answer is the stored value's tokens (``" v1 v2"``, without the line break).

    Lines start with a letter and end with a line break, which the pre-tokenizer splits on, so the
    document's tokens are the concatenation of its lines' tokens."""
    lines: list[list[int]] = []
    total = 0
    while total < length:
        batch = [kv_line(rng) for _ in range(64)]
        for text, enc in zip(batch, fast_tokenizer(tokenizer).encode_batch(batch, add_special_tokens=False)):
            lines.append((text, enc.ids))
            total += len(enc.ids)
    # the last lines, up to ``length`` tokens including the query
    kept, size = [], 0
    for text, ids in reversed(lines):
        if size + len(ids) + 8 > length:
            break
        kept.append((text, ids))
        size += len(ids)
    kept.reverse()
    keys = [text.split(":")[0] for text, _ in kept]
    uses = Counter(keys)
    far, before = [], size
    for i, (text, ids) in enumerate(kept):
        if before >= min_distance and uses[keys[i]] == 1:
            far.append(i)
        before -= len(ids)
    if not far:
        raise ValueError(f"length {length} is too short for a key {min_distance} tokens back")
    i = rng.choice(far)
    query = encode(tokenizer, f"{keys[i]}:")
    prompt = [t for _, ids in kept for t in ids] + query
    answer = kept[i][1][len(query):-1]                       # after "key:", before the line break
    return prompt, answer


def code_prompt(held_out: dict[str, list[int]], rng: random.Random, length: int, newline_ids=()) -> list[int]:
    """``length`` tokens of a held-out package (token ids), starting after a line break when one is near."""
    name = rng.choice(sorted(held_out))
    ids = held_out[name]
    if len(ids) < length + 1:
        ids = [t for n in sorted(held_out) for t in held_out[n]]
    start = rng.randrange(0, len(ids) - length)
    newline_ids = set(newline_ids)
    for s in range(start, min(start + 64, len(ids) - length)):
        if ids[s] in newline_ids:
            start = s + 1
            break
    return ids[start:start + length]


PLANT_WORDS = ("violet", "harbor", "amber", "falcon", "cedar", "orbit", "maple", "copper", "silver", "meadow",
               "lantern", "river", "granite", "willow", "ember", "canyon", "thistle", "cobalt", "juniper", "quartz",
               "saffron", "glacier", "heron", "marble", "nectar", "obsidian", "pepper", "raven", "sable", "tundra")


def retrieved(generated: list[int], answer: list[int]) -> bool:
    """Whether a target retrieved a stored value: its output (``generated``, token ids after the
    prompt) begins with the value's ids (``answer``, as the retrieval prompts return it)."""
    return list(generated[:len(answer)]) == list(answer)


def planted_retrieval_prompt(rng: random.Random, tokenizer, code: dict[str, str], length: int,
                             min_distance: int) -> tuple[list[int], list[int]]:
    """Code with one planted line ``KEY_WORD_1234 = "word-word-12"`` at least ``min_distance`` tokens
    before the end, the prompt ending with ``KEY_WORD_1234 = "`` -> ``(prompt ids, answer ids)``; the
    answer is the value and its closing quote. ``code``: {package: source text} (the held-out packages).

    The toy target's key-value documents (:func:`retrieval_prompt`) hold hundreds of look-alike keys;
    a small pretrained model retrieves a line planted in ordinary code instead."""
    name = rng.choice(sorted(code))
    text = code[name]
    if len(text) < 6 * length:
        text = "".join(code[n] for n in sorted(code))
    key = f"SECRET_{rng.choice(PLANT_WORDS).upper()}_{rng.randint(1000, 9999)}"
    value = f"{rng.choice(PLANT_WORDS)}-{rng.choice(PLANT_WORDS)}-{rng.randint(10, 99)}"
    query = f'\n{key} = "'
    start = text.find("\n", rng.randrange(0, max(1, len(text) - 8 * length))) + 1
    window = text[start:start + 4 * length]
    while len(encode(tokenizer, window)) < length and start + len(window) < len(text):
        window = text[start:start + 2 * len(window)]
    window = window[:window.rfind("\n")]
    ids = encode(tokenizer, window)
    if len(ids) < length:
        raise ValueError(f"the code holds fewer than {length} tokens")
    window = tokenizer.decode(ids[len(ids) - length:]) if hasattr(tokenizer, "decode") else window
    window = window[window.find("\n") + 1:]                      # start at a line
    # the planted line goes at a line break in the first third of the window (by characters)
    cut = window.find("\n", rng.randrange(len(window) // 20, len(window) // 3)) + 1
    full = window[:cut] + f'{key} = "{value}"\n' + window[cut:] + query
    return _question_at_end(tokenizer, full, cut, f'{value}"', length, min_distance, "planted line")


# -- held-out retrieval forms (evaluation only) ---------------------------------------------------------------
#
# Forms of prompt that no training form contains, with lexicons of their own: a support e-mail thread
# asking at the end for a parcel's tracking number given early, and a series of meeting minutes
# recalling at the end the venue agreed in an early meeting. Their filler is prose of the held-out
# packages (:func:`fold.demo.corpus.prose_paragraphs` of :func:`fold.demo.corpus.held_out_code`).

HELD_OUT_FIRST_NAMES = ("Maren", "Tobias", "Ingrid", "Rafael", "Yusuf", "Odile", "Keziah", "Lorcan", "Anouk",
                        "Teodor", "Saoirse", "Emeric", "Ilse", "Dario", "Wrenna", "Caspian")
HELD_OUT_LAST_NAMES = ("Oakley", "Varga", "Lindqvist", "Okafor", "Brennan", "Castellano", "Whitcombe", "Hargreave",
                       "Delacroix", "Nakamura", "Szabo", "Achterberg")
TRACKING_PREFIXES = ("RR", "CP", "EE", "LX", "RA", "CX")
TRACKING_COUNTRIES = ("DE", "GB", "FR", "NL", "SE", "PL", "IE")
TRACKING_PATTERN = r"\b[A-Z]{2}\d{9}[A-Z]{2}\b"          # a tracking number (UPU S10); no training form makes one
VENUE_PLACES = ("Ashcombe", "Brantwood", "Fellhaven", "Gorsedale", "Kilbarron", "Marlowmere", "Pendrick",
                "Quarrendon", "Rosslyn", "Tavistoke", "Wendover", "Ystrad")
VENUE_KINDS = ("Hall", "House", "Pavilion", "Centre", "Lodge")
VENUE_STREETS = ("Larkspur", "Hollybrook", "Foxglove", "Kingfisher", "Bramblewick", "Ferncliffe", "Pennywort",
                 "Sorrel", "Yarrow")
VENUE_WAYS = ("Road", "Lane", "Terrace", "Crescent")
HELD_OUT_LEXICON = (PLANT_WORDS + HELD_OUT_FIRST_NAMES + HELD_OUT_LAST_NAMES + TRACKING_PREFIXES + TRACKING_COUNTRIES
                    + VENUE_PLACES + VENUE_KINDS + VENUE_STREETS + VENUE_WAYS)
HELD_OUT_CUES = ("tracking number", "will be held at", "Subject: Re:", "## Decisions", "Present:")


def _question_at_end(tokenizer, text: str, stored_at: int, value: str, length: int, min_distance: int,
                     what: str) -> tuple[list[int], list[int]]:
    """``(prompt, answer)``: the last ``length`` tokens of ``text`` (which ends with the question's cue)
    and the tokens of ``value`` after it; ``stored_at``, the character offset in ``text`` where the
    stored copy begins, must be at least ``min_distance`` tokens before the end and inside the prompt."""
    ids = encode(tokenizer, text)
    back = len(ids) - len(encode(tokenizer, text[:stored_at]))
    prompt = ids[max(0, len(ids) - length):]
    if back > len(prompt) or back < min_distance:
        raise ValueError(f"the {what} is {back} tokens back in a {len(prompt)}-token prompt; "
                         f"wanted at least {min_distance}")
    full = encode(tokenizer, text + value)
    if full[:len(ids)] != ids:
        raise ValueError(f"the {what}'s value {value!r} does not tokenize apart from the cue before it")
    return prompt, full[len(ids):]


def _unit_document(rng: random.Random, tokenizer, unit, statement: str, final, length: int,
                   min_distance: int) -> tuple[str, int]:
    """Units of a document (``unit(rng) -> (head, tail, can_store)``) until ``length`` tokens, then
    ``final()`` (the last unit, ending with the question's cue), the ``statement`` placed between the
    head and tail of a unit that can store it, at least ``min_distance`` tokens (and at most
    ``length`` less a margin) before the end. Returns ``(text, offset of the statement)``."""
    n = lambda t: len(encode(tokenizer, t))  # noqa: E731
    units, sizes, total = [], [], n(statement)
    while total < length + 64:
        head, tail, can_store = unit(rng)
        units.append((head, tail, can_store))
        sizes.append((n(head), n(tail)))
        total += sum(sizes[-1])
    final = final()
    after = n(final)                                      # tokens from a unit's slot to the end
    slots = []
    for i in range(len(units) - 1, -1, -1):
        back = after + sizes[i][1] + n(statement)
        if units[i][2] and min_distance + 32 <= back <= length - 32:
            slots.append(i)
        after += sum(sizes[i])
    if not slots:
        raise ValueError(f"length {length} is too short to store a value {min_distance} tokens back")
    i = rng.choice(slots)
    before = "".join(h + t for h, t, _ in units[:i]) + units[i][0]
    text = before + statement + units[i][1] + "".join(h + t for h, t, _ in units[i + 1:]) + final
    return text, len(before)


def _held_out_names(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` distinct (first, last) names of the held-out lexicon, no two sharing a first or last name."""
    return list(zip(rng.sample(HELD_OUT_FIRST_NAMES, n), rng.sample(HELD_OUT_LAST_NAMES, n)))


def _dates(rng: random.Random, step_days: tuple[int, int]):
    """A calendar from a random day of 2026 on, each call ``step_days`` (low, high) days after the last."""
    day = datetime.date(2026, 1, 1) + datetime.timedelta(days=rng.randrange(365))

    def next_day() -> datetime.date:
        nonlocal day
        day += datetime.timedelta(days=rng.randint(*step_days))
        return day
    return next_day


def _filler(rng: random.Random, prose: list[str], max_chars: int = 600) -> str:
    short = [p for p in prose if len(p) <= max_chars]
    if not short:
        raise ValueError(f"prose holds no paragraph of at most {max_chars} characters")
    return rng.choice(short)


def email_retrieval_prompt(rng: random.Random, tokenizer, prose: list[str], length: int,
                           min_distance: int) -> tuple[list[int], list[int]]:
    """A support e-mail thread (``From:``/``To:``/``Date:``/``Subject:`` headers, bodies of held-out
    ``prose`` paragraphs) in which an agent's message, at least ``min_distance`` tokens before the end,
    gives a parcel's tracking number (``RR482913775DE``); the last message ends with ``"... the tracking
    number is"`` -> ``(prompt ids, answer ids)``, ``length`` prompt tokens; the answer is the number
    (with its leading space)."""
    customer, agent = _held_out_names(rng, 2)
    case = rng.randint(10000, 99999)
    value = f"{rng.choice(TRACKING_PREFIXES)}{rng.randint(10 ** 8, 10 ** 9 - 1)}{rng.choice(TRACKING_COUNTRIES)}"
    next_day = _dates(rng, (0, 1))

    def message(sender, recipient, body: list[str]) -> str:
        return (f"From: {sender[0]} {sender[1]} <{sender[0].lower()}.{sender[1].lower()}@kestrelworks.example>\n"
                f"To: {recipient[0].lower()}.{recipient[1].lower()}@kestrelworks.example\n"
                f"Date: {next_day():%a, %d %b %Y} {rng.randint(8, 18):02d}:{rng.randint(0, 59):02d}\nSubject: Re: Replacement controller board, case KW-{case}\n\n"
                f"Hi {recipient[0]},\n\n" + "".join(p + "\n\n" for p in body))

    turns = [0]                                           # the thread alternates: customer, agent, customer, ...

    def unit(rng):
        by_agent, turns[0] = turns[0] % 2 == 1, turns[0] + 1
        sender, recipient = (agent, customer) if by_agent else (customer, agent)
        head = message(sender, recipient, [_filler(rng, prose)])
        tail = (_filler(rng, prose) + "\n\n" if rng.random() < 0.5 else "") + \
            f"{rng.choice(('Best regards', 'Kind regards', 'Thanks'))},\n{sender[0]}\n\n"
        return head, tail, by_agent

    statement = (f"Your replacement board left our warehouse today. The tracking number is {value}, and the "
                 f"parcel should reach you within {rng.randint(2, 6)} working days.\n\n")
    final = lambda: message(customer, agent, [_filler(rng, prose)]) + (  # noqa: E731
        "The parcel has still not arrived, and the carrier's website cannot find it. Could you check on your "
        "side? For reference, the tracking number is")
    text, at = _unit_document(rng, tokenizer, unit, statement, final, length, min_distance)
    return _question_at_end(tokenizer, text, at + statement.index(value) - 1, " " + value, length, min_distance,
                            "tracking number")


def minutes_retrieval_prompt(rng: random.Random, tokenizer, prose: list[str], length: int,
                             min_distance: int) -> tuple[list[int], list[int]]:
    """A series of meeting minutes in Markdown (``Present:``, ``## Updates`` of held-out ``prose``
    paragraphs, ``## Decisions``, ``## Actions``) in which a decision, at least ``min_distance``
    tokens before the end, fixes an event's venue (``Ashcombe Hall, 14 Larkspur Road``); the last
    minutes end with ``"- As agreed earlier, the <event> will be held at"`` -> ``(prompt ids, answer
    ids)``, ``length`` prompt tokens; the answer is the venue (with its leading space)."""
    group = rng.choice(("Steering group", "Facilities committee", "Outreach working group", "Programme board"))
    event = rng.choice(("annual symposium", "founders' colloquium", "partners' summit", "regional offsite"))
    value = (f"{rng.choice(VENUE_PLACES)} {rng.choice(VENUE_KINDS)}, {rng.randint(2, 98)} "
             f"{rng.choice(VENUE_STREETS)} {rng.choice(VENUE_WAYS)}")
    people = [" ".join(name) for name in _held_out_names(rng, 6)]
    next_day = _dates(rng, (7, 14))

    def header() -> str:
        present = rng.sample(people, rng.randint(3, 5))
        return (f"# {group} meeting, {next_day():%A %d %B %Y}\n\n"
                f"Present: {', '.join(present)}\n\n")

    def unit(rng):
        head = header() + "## Updates\n\n" + "".join(_filler(rng, prose) + "\n\n" for _ in range(rng.randint(1, 2)))
        head += "## Decisions\n\n" + rng.choice(("- The minutes of the previous meeting were approved.\n",
                                                 "- The budget report was accepted as presented.\n",
                                                 "- No objections were raised to the revised schedule.\n"))
        who = rng.choice(people).split()[0]
        tail = (f"\n## Actions\n\n- {who} to {rng.choice(('circulate the draft', 'book the rooms', 'update the register', 'contact the speakers'))}"
                " before the next meeting.\n\n")
        return head, tail, True

    statement = f"- The {event} will be held at {value}, starting at {rng.randint(9, 14)}:{rng.choice(('00', '30'))}.\n"
    final = lambda: header() + f"## Reminders\n\n- As agreed earlier, the {event} will be held at"  # noqa: E731
    text, at = _unit_document(rng, tokenizer, unit, statement, final, length, min_distance)
    return _question_at_end(tokenizer, text, at + statement.index(value) - 1, " " + value, length, min_distance,
                            "venue")


HELD_OUT_FORMS = {"email": email_retrieval_prompt, "minutes": minutes_retrieval_prompt}
