"""A deterministic multi-document QA set for CacheBlend evaluation, generated here (no download).

Each document is ~`doc_tokens` tokens of neutral filler about one site, with one planted fact
("The access code for the north warehouse is 4817.", "The manager of the river depot is Ines
Kovac.", ...). Each question asks for one document's fact; its context is `docs_per_question`
documents from a shared pool, the answer in one of them and every other document holding a
fact of another kind (so the answer is findable, not a guess between look-alikes), in a seeded
order, so documents recur across questions in different positions, as in RAG.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

SITES = [
    "north warehouse", "river depot", "east archive", "harbour office", "hill observatory",
    "old granary", "south clinic", "glass factory", "mountain lodge", "central library",
    "salt mine", "forest station", "lake pumphouse", "west foundry", "island ferry terminal",
    "copper workshop", "desert weather post", "valley school", "canal lock house", "airfield hangar",
]

FILLER = [
    "The staff keep a logbook by the door and note every delivery that arrives during the week.",
    "In spring the paths around the building are repaired after the winter rains have washed them out.",
    "Visitors are asked to sign in at the front desk and to wear the yellow badge at all times.",
    "The heating system was replaced two years ago, and the old boiler now sits in the yard.",
    "A small garden behind the main hall grows herbs that the kitchen uses for soup.",
    "Most of the equipment is inspected once a month by a technician from the regional office.",
    "The windows face the morning sun, so the rooms on the east side warm up early in the day.",
    "During the annual open day, local children are shown how the machines work.",
    "The roof was painted grey to match the hills, which makes the site hard to see from the road.",
    "A bus stops at the gate four times a day, although most workers arrive by bicycle.",
    "Records older than ten years are boxed and moved to a storage room in the basement.",
    "The site manager holds a short meeting every Monday to plan the work of the week.",
    "Rain water is collected in two large tanks and used to clean the floors and the yard.",
    "An old map on the wall shows the area as it was before the new road was built.",
    "The cafeteria serves lunch at noon, and on Fridays there is fresh bread from the village.",
    "Fire drills are held twice a year, and everyone gathers by the flagpole afterwards.",
    "The electricity comes from the grid, with a diesel generator kept ready for storms.",
    "Birds nest under the eaves every summer, and the staff take care not to disturb them.",
    "A notice board lists the phone numbers of the nearest hospital and the police station.",
    "The floors are swept every evening, and the bins are emptied on Tuesdays and Fridays.",
]

# (fact sentence, question, value maker): one kind of planted fact each.
FACT_KINDS: list[tuple[str, str, Callable[[random.Random], str]]] = [
    ("The access code for the {site} is {value}.", "What is the access code for the {site}?",
     lambda r: str(r.randint(1000, 9999))),
    ("The manager of the {site} is {value}.", "Who is the manager of the {site}?",
     lambda r: r.choice(["Ines Kovac", "Tomas Berg", "Alma Reyes", "Jonas Weber", "Mira Ito", "Paul Okafor"])),
    ("The front door of the {site} is painted {value}.", "What colour is the front door of the {site}?",
     lambda r: r.choice(["green", "orange", "purple", "yellow", "red", "blue"])),
    ("The {site} was founded in {value}.", "In which year was the {site} founded?",
     lambda r: str(r.randint(1850, 1990))),
    ("The nearest town to the {site} is {value}.", "What is the nearest town to the {site}?",
     lambda r: r.choice(["Dunmore", "Kestrel Bay", "Ashford", "Lindholm", "Marrow", "Pell"])),
    ("The mascot of the {site} is a {value}.", "What animal is the mascot of the {site}?",
     lambda r: r.choice(["fox", "heron", "badger", "otter", "owl", "lynx"])),
]

SYSTEM = ("You answer questions using only the documents the user provides. "
          "Reply with the requested value only.")


@dataclass(frozen=True)
class Document:
    site: str
    kind: int  # index into FACT_KINDS
    value: str
    text: str


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    doc_ids: tuple[int, ...]  # into the pool, in prompt order
    answer_doc: int


def make_documents(num_docs: int, doc_tokens: int, count_tokens: Callable[[str], int],
                   seed: int = 0) -> list[Document]:
    """Returns `num_docs` documents of about `doc_tokens` tokens (per `count_tokens`); document
    i plants one fact of kind `i % len(FACT_KINDS)` at a seeded sentence position."""
    if not 1 <= num_docs <= len(SITES):
        raise ValueError(f"num_docs must be in [1, {len(SITES)}], got {num_docs}")
    rng = random.Random(seed)
    docs = []
    for i, site in enumerate(SITES[:num_docs]):
        kind = i % len(FACT_KINDS)
        fact, _q, make_value = FACT_KINDS[kind]
        value = make_value(rng)
        sentences = [f"This report describes the {site}."]
        while count_tokens(" ".join(sentences)) < doc_tokens:
            sentences.append(rng.choice(FILLER))
        sentences.insert(rng.randint(1, len(sentences)), fact.format(site=site, value=value))
        docs.append(Document(site, kind, value, " ".join(sentences)))
    return docs


def make_questions(docs: list[Document], num_questions: int, docs_per_question: int,
                   seed: int = 0) -> list[Question]:
    """Returns `num_questions` questions; each takes its answer document round-robin and
    `docs_per_question - 1` distractors of other fact kinds (distinct kinds) from the pool, in a
    seeded order."""
    kinds = {d.kind for d in docs}
    if not 1 <= docs_per_question <= len(kinds):
        raise ValueError(f"docs_per_question must be in [1, {len(kinds)}] (fact kinds in the pool), "
                         f"got {docs_per_question}")
    rng = random.Random(seed + 1)
    out = []
    for i in range(num_questions):
        answer = i % len(docs)
        ids, used = [answer], {docs[answer].kind}
        for j in rng.sample(range(len(docs)), len(docs)):
            if len(ids) == docs_per_question:
                break
            if docs[j].kind not in used:
                ids.append(j)
                used.add(docs[j].kind)
        rng.shuffle(ids)
        d = docs[answer]
        out.append(Question(FACT_KINDS[d.kind][1].format(site=d.site), d.value, tuple(ids), answer))
    return out


def chat_segments(tokenizer, docs: list[Document], q: Question) -> list[str]:
    """Returns the chat-templated prompt of `q` as segments: [template head, documents...,
    question + generation prompt]. Each document segment is the same string wherever it
    appears, so its tokens (and cached K/V) are too."""
    marker = "\x00DOCS\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": marker + "Question: " + q.question}],
        tokenize=False, add_generation_prompt=True)
    head, tail = text.split(marker)
    return [head, *(f"Document: {docs[i].text}\n\n" for i in q.doc_ids), tail]
