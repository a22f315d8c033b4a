"""The generator of headway's built-in chat prompt corpus (``chat:train`` / ``chat:extra`` /
``chat:heldout`` / ``chat:dev`` / ``chat:test``). Not part of the package: headway reads the frozen
output, ``headway/data/corpora/chat.jsonl.gz`` and ``chat-test.jsonl.gz`` (their checksums in
``chat.json`` beside them), so every install reads the same prompts in the same order, whatever its
Python version.

    python tools/chat_corpus.py            # re-freeze into headway/data/corpora/ (changes the corpus!)
    python tools/chat_corpus.py --check    # does this generator, on this Python, still write the shipped file?

Re-freezing changes the prompts that existing distilled datasets and heads were made from: do it only
to change the corpus on purpose (bump ``SEED``), and update the pinned checksum in the tests.

Distilling a chat model needs a few thousand varied instructions; this module writes them from
templates crossed with subject lists kept here, plus material every Python install has (stdlib
docstrings, short stdlib functions and the ``pydoc_data`` help topics).

- **train** (~3,000 prompts, ~37 task families): explanations, how-to, lists, rewriting, grammar,
  translation, classification, extraction, code, maths, poems, stories, ...
- **extra** (~2,800 prompts): the train families again, drawn from other random streams and never
  repeating a train prompt: more distilled answers for a drafter once train's are all used.
- **heldout** (~330 prompts, 6 other families): comparison essays, advice letters, role-play,
  step-by-step plans, FAQ answers, interview-style Q&A. Neither family nor subject lists are shared with
  train, so a benchmark on it measures how well heads generalise to a new style.
- **dev** (the last ``DEV_PROMPTS`` held-out prompts): for training-time evaluation and calibration
  (``chat:dev``). Benchmarks take a prefix of held-out prompts shorter than ``len(heldout) - DEV_PROMPTS``,
  so the prompts a benchmark times were never used to evaluate, calibrate or select heads.
- **test** (~300 prompts of the six held-out families, ``TEST_PER_FAMILY`` each, drawn from random
  streams of their own and never repeating a held-out prompt): the split reported numbers are
  measured on, which no recipe choice, ``tune`` run or ablation reads. It ships in a file of its own
  (``chat-test.jsonl.gz``), so adding it left ``chat.jsonl.gz`` byte for byte as it was.

Everything is deterministic: each family draws from its own ``random.Random`` seeded by a fixed
string, prompts are deduplicated by normalised text, and families are interleaved round-robin so any
prefix (``limit=N``) is varied. Held-out prompts are all hand-written templates, identical on every
Python version; the five stdlib-derived train families follow the running Python's sources, so this
generator's train split differs slightly between Python versions. That is why the package ships
its output (frozen on Python 3.11.7) instead of running it.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib
import inspect
import json
import platform
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from random import Random
from typing import Callable, Sequence


SPLITS = ("train", "heldout", "extra", "test")
MAIN_SPLITS = ("train", "extra", "heldout")  # chat.jsonl.gz; test has a file of its own
SEED = "headway-chat-corpus-v1"
TRAIN_PER_FAMILY = 84
EXTRA_PER_FAMILY = 84  # more prompts of the train families, for more distilled data than train alone gives
HELDOUT_PER_FAMILY = 55
TEST_PER_FAMILY = 50  # the held-out families again, none repeating a held-out prompt
DEV_PROMPTS = 120  # the held-out split's tail, all six families (round-robin order)
MIN_CHARS, MAX_CHARS = 15, 800  # ~200 tokens at most for English text / short code
SNIPPET_CHARS = 520

Maker = Callable[[Random], str]


class NoMaterial(Exception):
    """A stdlib-derived family found nothing to draw from on this Python."""


@dataclass(frozen=True)
class Family:
    name: str
    split: str
    make: Maker  # one prompt from the family's random stream
    size: int  # how many distinct prompts to draw


@dataclass(frozen=True)
class ChatPrompt:
    family: str
    index: int  # position within its family
    text: str

    def id(self, split: str) -> str:
        return f"chat:{split}:{self.family}:{self.index}"


# ============================================================== shared subject lists (train)

NAMES = ("Amara", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Keiko",
         "Liam", "Maya", "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Valeria",
         "Wen", "Xavier", "Yusuf", "Zoe", "Aisha", "Bruno", "Carmen", "Diego", "Esther", "Felix", "Greta",
         "Hassan", "Ingrid", "Jonas", "Kavya", "Lucia", "Mateo", "Nadia")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Buenos Aires", "Cairo", "Melbourne", "Oslo", "Mumbai",
          "Mexico City", "Istanbul", "Vancouver", "Seoul", "Marrakesh", "Prague", "Lima", "Hanoi", "Cape Town",
          "Edinburgh", "Montreal", "Singapore", "Vienna", "Copenhagen", "Dublin", "Kyoto", "Santiago", "Athens",
          "Reykjavik", "Manila", "Krakow", "Havana", "Accra", "Auckland", "Helsinki", "Barcelona", "Chicago",
          "Bangkok", "Tbilisi", "Quebec City", "Zanzibar City")
COUNTRIES = ("Portugal", "Kenya", "Japan", "Canada", "Argentina", "Egypt", "Australia", "Norway", "India",
             "Mexico", "Turkey", "South Korea", "Morocco", "Peru", "Vietnam", "Iceland", "Chile", "Greece",
             "New Zealand", "Finland", "Ghana", "Indonesia", "Poland", "Brazil", "Ireland", "Switzerland", "Nepal",
             "Ethiopia", "Colombia", "Mongolia", "Sweden", "Thailand", "Tanzania", "Uruguay", "Malaysia", "Jordan",
             "Croatia", "Senegal", "Bolivia", "Estonia")
SCIENCE = ("photosynthesis", "plate tectonics", "natural selection", "entropy", "the greenhouse effect",
           "black holes", "DNA replication", "the water cycle", "vaccination and immunity",
           "quantum entanglement", "the Doppler effect", "osmosis", "nuclear fusion in stars", "radioactive decay",
           "special relativity", "electromagnetic induction", "the placebo effect", "ocean tides",
           "cellular respiration", "the nitrogen cycle", "antibiotic resistance", "the periodic table",
           "chemical bonds", "acids and bases", "enzymes", "the Big Bang", "dark matter", "gravitational waves",
           "superconductivity", "semiconductors", "food webs", "mitosis", "the human microbiome",
           "synaptic transmission", "circadian rhythms", "the carbon cycle", "volcanic eruptions",
           "earthquakes and seismic waves", "the ozone layer", "ocean acidification", "genetic mutations",
           "CRISPR gene editing", "the electromagnetic spectrum", "sound waves", "friction",
           "Newton's laws of motion", "kinetic and potential energy", "buoyancy", "magnetism", "static electricity",
           "the life cycle of a star", "exoplanets", "the Coriolis effect", "catalysts", "half-life", "allergies",
           "hormones", "biodiversity", "pollination", "erosion", "glaciers")
SOCIETY = ("inflation", "compound interest", "opportunity cost", "supply and demand", "comparative advantage",
           "central bank interest rates", "gross domestic product", "the tragedy of the commons",
           "game theory", "the prisoner's dilemma", "confirmation bias", "cognitive dissonance",
           "the sunk cost fallacy", "diminishing returns", "economies of scale", "index funds", "a recession",
           "the separation of powers", "federalism", "proportional representation", "the social contract",
           "universal basic income", "carbon pricing", "the minimum wage", "globalisation", "the gig economy",
           "urbanisation", "the scientific method", "peer review", "statistical significance",
           "correlation and causation", "the Dunning-Kruger effect", "the bystander effect",
           "Maslow's hierarchy of needs", "behavioural economics", "moral hazard", "network effects",
           "copyright and fair use", "progressive taxation", "microfinance")
AUDIENCES = ("a ten-year-old", "a high-school student", "a busy manager with no science background",
             "a first-year university student", "my grandmother", "someone learning English",
             "an expert who wants a quick refresher", "a curious teenager", "a journalist on a deadline",
             "a primary school class")
WORDS = ("ubiquitous", "serendipity", "ephemeral", "pragmatic", "meticulous", "resilient", "ambiguous", "candid",
         "diligent", "eloquent", "frugal", "gregarious", "hubris", "impeccable", "juxtapose", "lucid", "mundane",
         "nostalgia", "obsolete", "paradox", "quintessential", "redundant", "scrutinize", "tenacious", "verbose",
         "whimsical", "zealous", "benevolent", "cacophony", "deference", "empathy", "facetious", "gratuitous",
         "hypothetical", "idiosyncratic", "jargon", "laconic", "mitigate", "nuance", "ostensibly", "placate",
         "quixotic", "reticent", "sanguine", "trepidation", "unprecedented", "vicarious", "wanderlust", "catalyst",
         "dichotomy", "euphemism", "fallacy", "heuristic", "irony", "metaphor", "procrastinate", "rhetoric",
         "stoic", "altruism", "ineffable")
EVENTS = ("the fall of the Western Roman Empire", "the signing of the Magna Carta",
          "the invention of the printing press",
          "the Black Death", "the voyages of Zheng He", "the Protestant Reformation", "the Columbian Exchange",
          "the Scientific Revolution", "the Industrial Revolution", "the American Revolution", "the French Revolution",
          "the Haitian Revolution", "the abolition of the transatlantic slave trade", "the unification of Germany",
          "the Meiji Restoration", "the building of the Suez Canal", "the First World War",
          "the Russian Revolution of 1917", "the Great Depression", "the Second World War",
          "the founding of the United Nations", "the partition of India", "the Marshall Plan", "the Cold War",
          "the Cuban Missile Crisis", "the decolonisation of Africa", "the civil rights movement in the United States",
          "the first Moon landing", "the fall of the Berlin Wall", "the end of apartheid in South Africa",
          "the collapse of the Soviet Union", "the invention of the World Wide Web", "the Silk Road",
          "the construction of the Great Wall of China", "the Renaissance in Florence",
          "the Ottoman conquest of Constantinople", "the Inca road system", "the expansion of the Mongol Empire",
          "the 2008 financial crisis", "the Chernobyl disaster", "the discovery of penicillin",
          "the women's suffrage movement", "the Peace of Westphalia", "the eradication of smallpox")
OBJECTS = ("refrigerator", "microwave oven", "bicycle", "zip", "ballpoint pen", "smoke detector", "thermostat",
           "electric kettle", "smartphone camera", "pair of noise-cancelling headphones", "washing machine",
           "toaster", "vacuum cleaner", "solar panel", "electric car battery", "GPS receiver", "barcode scanner",
           "contactless card", "LED light bulb", "induction hob", "pressure cooker", "quartz watch", "compass",
           "umbrella", "lift", "escalator", "air conditioner", "heat pump", "espresso machine", "sewing machine",
           "padlock", "can opener", "mechanical clock", "piano", "electric guitar", "loudspeaker", "microphone",
           "laser printer", "3D printer", "Wi-Fi router", "hard drive", "USB stick", "touchscreen", "dishwasher",
           "wind turbine", "hot-air balloon", "fire extinguisher", "digital thermometer", "hearing aid",
           "contact lens", "e-bike", "smartwatch", "dehumidifier", "water filter", "robot lawnmower")
PROFESSIONS = ("nurse", "electrician", "architect", "air traffic controller", "librarian", "data scientist",
               "firefighter", "pharmacist", "civil engineer", "marine biologist", "sommelier", "court interpreter",
               "beekeeper", "paramedic", "carpenter", "urban planner", "veterinarian", "pilot", "plumber",
               "translator", "archaeologist", "sound engineer", "software tester", "midwife", "park ranger",
               "journalist", "tax accountant", "chef", "dentist", "physiotherapist", "museum curator",
               "UX designer", "meteorologist", "primary school teacher", "social worker", "locksmith", "barista",
               "farmer", "tailor", "graphic designer", "geologist", "radio presenter", "lawyer",
               "cybersecurity analyst", "zookeeper", "surveyor", "optician", "actuary", "speech therapist",
               "wind turbine technician")
FOODS = ("lentils", "quinoa", "sweet potatoes", "avocados", "dark chocolate", "kimchi", "olive oil", "oats",
         "spinach", "chickpeas", "tofu", "salmon", "brown rice", "blueberries", "yoghurt", "almonds", "mushrooms",
         "eggs", "cabbage", "mangoes", "sourdough bread", "miso", "buckwheat", "sardines", "beetroot", "pumpkin",
         "couscous", "tempeh", "cauliflower", "pomegranates", "ginger", "garlic", "cinnamon", "honey", "peanuts",
         "green tea", "plantains", "cassava", "seaweed", "figs", "feta cheese", "black beans", "barley", "pears",
         "turmeric")
SPORTS = ("football", "basketball", "cricket", "rugby union", "tennis", "badminton", "table tennis", "volleyball",
          "ice hockey", "baseball", "golf", "road cycling", "marathon running", "swimming", "rowing", "fencing",
          "judo", "archery", "curling", "water polo", "handball", "lacrosse", "squash", "sumo wrestling",
          "gymnastics", "rock climbing", "surfing", "skateboarding", "sailing", "triathlon", "kabaddi", "hurling",
          "ultimate frisbee", "figure skating", "biathlon", "netball")
EMOTIONS = ("joy", "nostalgia", "nervousness", "pride", "loneliness", "relief", "curiosity", "gratitude",
            "jealousy", "awe", "frustration", "contentment", "embarrassment", "hope", "boredom", "anticipation",
            "homesickness", "regret", "excitement", "calm")
ANIMALS = ("hedgehog", "penguin", "red fox", "sloth", "hummingbird", "tortoise", "otter", "snow leopard", "koala",
           "crow", "dolphin", "chameleon", "beaver", "owl", "giraffe", "seahorse", "elephant", "bumblebee", "wolf",
           "kangaroo")
BUSINESSES = ("bakery", "bicycle repair shop", "bookshop café", "dog-walking service", "plant nursery",
              "vintage clothing store", "climbing gym", "board-game café", "taco food truck", "pottery studio",
              "tea shop", "computer repair shop", "florist", "yoga studio", "barbershop", "escape room",
              "second-hand furniture shop", "ice-cream parlour", "photography studio", "coworking space",
              "craft brewery", "sushi bar")
FOOD_BUSINESSES = ("bakery", "bookshop café", "board-game café", "taco food truck", "tea shop", "ice-cream parlour",
                   "craft brewery", "sushi bar")
POLICIES = ("universal basic income", "carbon pricing", "the minimum wage", "progressive taxation",
            "proportional representation", "copyright and fair use")
PROGRAMMING = ("recursion", "closures", "garbage collection", "dependency injection", "Big-O notation", "hash tables",
               "race conditions", "mutexes", "REST APIs", "database indexes", "SQL joins", "git rebase",
               "memoization", "unit testing", "continuous integration", "the event loop", "generators",
               "decorators", "polymorphism", "inheritance", "immutability", "pure functions", "type inference",
               "pointers", "stack and heap memory", "the TCP handshake", "DNS resolution", "public-key cryptography",
               "password hashing with salts", "regular expressions", "virtual environments", "containers",
               "caching", "load balancing", "message queues", "idempotency", "pagination", "lazy evaluation",
               "binary search trees", "breadth-first search", "dynamic programming", "the observer pattern",
               "semantic versioning", "technical debt", "floating-point rounding errors", "Unicode and UTF-8",
               "JSON Web Tokens", "CORS", "database sharding")
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Rust", "Go", "Java", "C", "C#", "Kotlin", "Ruby")
HUMAN_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Japanese",
                   "Indonesian", "Turkish", "Polish", "Swahili")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
SCENES = ("a thunderstorm over the sea", "the first snowfall of winter", "a quiet library at closing time",
          "morning fog over a river", "a busy train station", "a lighthouse at night", "an old oak tree",
          "autumn leaves in a park", "the desert at noon", "a mountain lake", "fireflies in a summer field",
          "city lights from a rooftop", "a lost glove on a bench", "a garden after rain", "a kite on a windy day",
          "the last day of summer", "a crowded night market", "an empty playground", "a train crossing a bridge",
          "bread baking in the morning")

# Everything train draws its subjects from (held-out lists must not share an item; tested).
TRAIN_SUBJECTS: dict[str, tuple[str, ...]] = {
    "names": NAMES, "cities": CITIES, "countries": COUNTRIES, "science": SCIENCE, "society": SOCIETY,
    "words": WORDS, "events": EVENTS, "objects": OBJECTS, "professions": PROFESSIONS, "foods": FOODS,
    "sports": SPORTS, "emotions": EMOTIONS, "animals": ANIMALS, "businesses": BUSINESSES,
    "programming": PROGRAMMING, "scenes": SCENES,
}


# ============================================================== helpers

def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def _plural(noun: str) -> str:
    if noun.endswith("wolf"):
        return noun[:-1] + "ves"
    return noun + ("es" if noun.endswith(("x", "s", "ch")) else "s")


def _articles(text: str) -> str:
    """'a' -> 'an' before a vowel sound ("an architect", "an urban planner"; not "a unique", "a one-off")."""
    return re.sub(r"\b([Aa]) (?=[aiAI]|[eE](?!u)|[oO](?!ne\b)|[uU](?:[lmrLMR]|n(?!i))|LED\b)", r"\1n ", text)


def _casual(r: Random, text: str) -> str:
    """The same request typed quickly: lower-case, no final stop, sometimes a chatty opener."""
    text = text[0].lower() + text[1:]
    if text.endswith("."):
        text = text[:-1]
    return r.choice(("hey, ", "quick question: ", "ok so ", "", "hi! ")) + text


def _register(r: Random, text: str, p: float = 0.15) -> str:
    return _casual(r, text) if r.random() < p else text


FORMATS = ("Keep it under 100 words.", "Answer in three bullet points.", "Use a numbered list.",
           "Give one concrete example.", "Answer in exactly two short paragraphs.",
           'Respond in JSON with the keys "summary" and "example".', "End with a one-sentence summary.",
           "Use simple words.", "Include a short analogy.", "Answer in about 50 words.",
           "Start with a one-line answer, then explain.", "Use headings for each part.")


def _fmt(r: Random, p: float = 0.45) -> str:
    return (" " + r.choice(FORMATS)) if r.random() < p else ""


# ============================================================== sentences and notes (rewrite, grammar, ...)

SENTENCES = (
    "hey {name}, the {object} in the office is broken again, can you have a look at it before {day}?",
    "{name} thinks the new stall selling {food} near the station is much better than the old one, but it is quite "
    "expensive.",
    "We regret to inform you that the {sport} match scheduled for {day} has been postponed because of the weather.",
    "The meeting ran late because everyone kept arguing about whether to buy a new {object}.",
    "I think we should maybe move the team lunch to {day} if that works for most people.",
    "Our {profession} told us that the project is behind schedule and that we need two more weeks.",
    "The {object} I bought last week has stopped working and the shop will not give me a refund.",
    "{name} is moving to {city} next month to start a new job as a {profession}.",
    "The train to {city} was cancelled, so we had to take a bus that took almost five hours.",
    "Please note that the {object} on the second floor is out of order until further notice.",
    "It is surprising how much the price of {food} has gone up at the market this year.",
    "The local {profession}s are running a free workshop on {day} afternoon, and everyone is welcome.",
    "Due to high demand, orders of the new {object} may take up to three weeks to arrive.",
    "It rained all weekend in {city}, so we stayed inside and tried a new recipe with {food}.",
    "{name} and {name2} have been friends since they were children in {city}.",
    "The report that the {profession} wrote was long, but it was clear and easy to follow.",
    "If the {object} had been cheaper, I would have bought two of them.",
    "Each of the students has to bring their own lunch on the trip to {city}.",
    "There are fewer people at the {sport} club this year than there were last year.",
    "The company said its new {object} would be ready in spring, but nobody believes it.",
    "{name} has worked as a {profession} in {city} for almost twenty years.",
    "When I visited {country}, the thing I remember most was the {food} at a tiny family restaurant.",
    "Your order has been shipped and should arrive on {day}, unless there is a delay at the warehouse.",
    "The children were so excited about the trip to {country} that they could not sleep.",
    "honestly the {object} is fine but the instructions were a total nightmare to follow",
    "The council is planning to close the old sports ground and build flats there instead.",
    "{name} forgot the keys again, so the {profession} had to wait outside in the cold for an hour.",
    "Many people in {city} would rather walk than wait for a bus that is always late.",
    "Before the {sport} final, the coach told the team to stay calm and trust each other.",
    "I have been trying to learn {language} for a year, but I still cannot follow a conversation.",
)

NOTES = (
    "Hi all, a quick update from {name}. The {object} in the kitchen broke on {day}, and the repair person can only "
    "come next week. Until then, please use the one on the second floor. Also, the team lunch has moved to {day2}, "
    "so let me know if you can't make it.",
    "{city} will host its first {sport} festival this summer. Organisers expect around {n} thousand visitors over "
    "three days, and local {profession}s have been asked to volunteer. Some residents worry about noise and traffic, "
    "while shop owners hope the event will bring in new customers.",
    "Our {food_business} had a mixed month. Sales of dishes with {food} went up by {pct} percent, but two suppliers "
    "raised their prices and the {object} broke twice. We are thinking about changing suppliers and raising prices "
    "slightly in {month}.",
    "Dear residents, the water supply on Elm Street will be interrupted on {day} from 9 am to 3 pm while pipes are "
    "replaced. Please store some drinking water in advance. Neighbours who need help carrying water can contact "
    "{name} at the community centre.",
    "Last night's meeting of the {city} hiking group decided three things: the spring walk will start at the old "
    "bridge, members will pay {n} euros a year, and {name} will replace {name2} as treasurer. The next meeting is on "
    "{day}.",
    "{name} started learning {language} in {month} with podcasts and a weekly class. After three months, {name} can "
    "order food and ask for directions, but still struggles to follow fast speech. The teacher suggests watching "
    "short films with subtitles.",
    "The new {object} we tested performed well in most areas. Setup took under ten minutes and the battery lasted "
    "{n} hours. However, the buttons are small, the manual is confusing, and customer support took two days to "
    "answer a simple question.",
    "A study of {n} hundred adults in {country} found that people who walked for at least thirty minutes a day "
    "reported better sleep. The researchers warn that the study shows a link, not a cause, and that people who walk "
    "more may differ in other ways.",
    "Reminder: the library closes early on {day} for staff training. Books due that day can be returned the next "
    "morning without a fine. The children's reading hour has moved to Saturday, and the {object} in the study room "
    "is being replaced.",
    "{name} has been a {profession} in {city} for twelve years and recently opened a small {business}. Business was "
    "slow at first, but word of mouth helped, and there is now a waiting list at weekends. The next goal is to hire "
    "a second employee.",
    "The {sport} club's annual report shows membership grew from {n} to {m} members. Most newcomers are teenagers, "
    "thanks to free taster sessions. The club now needs more volunteer coaches and a bigger budget for equipment.",
    "Travel notice: because of engineering work, trains between {city} and {city2} will be replaced by buses on "
    "{day}. Journeys will take about forty minutes longer, and bicycles cannot be taken on replacement buses.",
)


def _slots(r: Random) -> dict[str, object]:
    name, name2 = r.sample(NAMES, 2)
    city, city2 = r.sample(CITIES, 2)
    day, day2 = r.sample(DAYS, 2)
    n = r.randint(3, 60)
    return {"name": name, "name2": name2, "city": city, "city2": city2, "day": day, "day2": day2,
            "object": r.choice(OBJECTS), "food": r.choice(FOODS), "sport": r.choice(SPORTS),
            "profession": r.choice(PROFESSIONS), "country": r.choice(COUNTRIES), "business": r.choice(BUSINESSES),
            "food_business": r.choice(FOOD_BUSINESSES),
            "language": r.choice(HUMAN_LANGUAGES), "month": r.choice(MONTHS), "n": n, "m": n + r.randint(5, 40),
            "pct": r.randint(5, 40)}


def _sentence(r: Random) -> str:
    return r.choice(SENTENCES).format(**_slots(r))


def _note(r: Random) -> str:
    return r.choice(NOTES).format(**_slots(r))


GRAMMAR_ERRORS = ((r"\btheir\b", "there"), (r"\bthere\b", "their"), (r"\bits\b", "it's"), (r"\bhas\b", "have"),
                  (r"\bwas\b", "were"), (r"\bis\b", "are"), (r"\bthe ", ""), (r"\ba ", ""), (r"\bto\b", "too"),
                  (r"\bwould have\b", "would of"), (r"\bfewer\b", "less"), (r"\bwere\b", "was"), (r"\bthan\b", "then"),
                  (r"\bcannot\b", "can not"), (r"\bhave\b", "has"))


def _corrupt(r: Random, text: str) -> str:
    """Introduce two mistakes (grammar swaps, else a transposed letter)."""
    changed = 0
    for pattern, repl in r.sample(GRAMMAR_ERRORS, len(GRAMMAR_ERRORS)):
        new = re.sub(pattern, repl, text, count=1)
        if new != text:
            text, changed = new, changed + 1
        if changed == 2:
            return text
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 6 and w.isalpha()]
    if long:
        i = r.choice(long)
        w = words[i]
        j = r.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


# ============================================================== knowledge families

def _explain_science(r: Random) -> str:
    c, a = r.choice(SCIENCE), r.choice(AUDIENCES)
    return r.choice((f"Explain {c} to {a}.", f"How would you explain {c} to {a}?",
                     f"What is {c}, and why does it matter?", f"Give a clear, accurate explanation of {c}.",
                     f"I'm studying for an exam. Can you explain {c} and mention one common misconception?",
                     f"Describe {c} in plain language, then give a real-world example.",
                     f"What questions are scientists still trying to answer about {c}?")) + _fmt(r)


def _explain_society(r: Random) -> str:
    c, a = r.choice(SOCIETY), r.choice(AUDIENCES)
    text = r.choice((f"Explain {c} to {a}.", f"What is {c}? Give an everyday example.",
                     f"Why do economists and social scientists care about {c}?",
                     f"Can you explain {c} without using any jargon?",
                     f"I keep seeing '{c}' in the news. What does it mean, and how could it affect me?",
                     f"What do people most often misunderstand about {c}?"))
    return _register(r, text) + _fmt(r)


def _define_word(r: Random) -> str:
    w = r.choice(WORDS)
    return r.choice((f"What does the word '{w}' mean? Use it in two example sentences.",
                     f"Define '{w}' and give its origin if you know it.",
                     f"Give a simple definition of '{w}' that a twelve-year-old would understand.",
                     f"How is the word '{w}' pronounced, and what does it mean?",
                     f"Use '{w}' correctly in a short paragraph about {r.choice(SCENES)}.",
                     f"What's the difference in tone between '{w}' and a plainer word with a similar meaning?",
                     f"Write three sentences using '{w}': one formal, one casual and one funny."))


def _history(r: Random) -> str:
    e = r.choice(EVENTS)
    text = r.choice((f"What were the main causes of {e}?", f"Summarise {e} in five bullet points.",
                     f"What were the long-term consequences of {e}?",
                     f"Who were the key people involved in {e}, and what did they do?",
                     f"Why do historians still debate {e}?", f"Write a short timeline of {e}.",
                     f"Explain {e} to someone who has never studied history.",
                     f"How did {e} affect the daily lives of ordinary people?",
                     f"What is one thing most people get wrong about {e}?"))
    return _register(r, text, 0.1) + _fmt(r, 0.3)


def _geography(r: Random) -> str:
    c, city = r.choice(COUNTRIES), r.choice(CITIES)
    text = r.choice((f"What is {city} known for?", f"Describe the climate of {c} across the year.",
                     f"What languages are spoken in {c}, and why?", f"Give a brief history of {city}.",
                     f"Name three landmarks in {city} and say why each is worth seeing.",
                     f"What are the main industries in {c}?", f"What is traditional food like in {c}?",
                     f"Describe the geography of {c}: mountains, rivers, coasts and regions.",
                     f"Which festivals are celebrated in {c}, and what happens during them?",
                     f"What is public transport like in {city}?"))
    return _register(r, text) + _fmt(r, 0.3)


def _object_works(r: Random) -> str:
    o = r.choice(OBJECTS)
    text = r.choice((f"How does a {o} work?", f"Explain how a {o} works, step by step, for a curious child.",
                     f"What are the main parts of a {o}, and what does each one do?",
                     f"Who invented the {o}, and how has it changed over time?",
                     f"What should I look for when buying a {o}?",
                     f"What are the most common reasons a {o} stops working?",
                     f"Describe the physics behind a {o} in under 120 words."))
    return _register(r, text) + _fmt(r, 0.25)


def _profession(r: Random) -> str:
    p = r.choice(PROFESSIONS)
    return r.choice((f"What does a {p} do on a typical day?", f"What skills and training does a {p} need?",
                     f"Describe three challenges a {p} faces at work.",
                     f"How has technology changed the job of a {p} in the last twenty years?",
                     f"What are the best and worst parts of working as a {p}?",
                     f"Write a short job advertisement for a {p}.",
                     f"Which school subjects are most useful for someone who wants to become a {p}?")) + _fmt(r, 0.3)


def _food(r: Random) -> str:
    f = r.choice(FOODS)
    text = r.choice((f"What are the nutritional benefits of {f}?",
                     f"Give me a simple recipe that uses {f} as the main ingredient.",
                     f"Suggest a vegan dish with {f} that takes under 30 minutes.",
                     f"What is the history of {f} as a food, and how is it produced today?",
                     f"How should I store {f} so it lasts longer?", f"Suggest three meals for the week that use {f}.",
                     f"What flavours go well with {f}?",
                     f"Write a recipe with {f} that a child could help make, with only five ingredients."))
    return _register(r, text) + _fmt(r, 0.25)


def _sports(r: Random) -> str:
    s = r.choice(SPORTS)
    text = r.choice((f"Explain the basic rules of {s}.", f"How is scoring done in {s}?",
                     f"What equipment do you need to start {s}?", f"Where and when did {s} begin?",
                     f"What skills should a beginner practise first in {s}?",
                     f"What are the biggest competitions in {s}?",
                     f"What kind of fitness does {s} demand, and how do athletes train for it?",
                     f"Explain {s} to someone watching it for the first time."))
    return _register(r, text) + _fmt(r, 0.3)


WHY = ("Why is the sky blue?", "Why does ice float on water?", "Why do onions make people cry?",
       "Why do we get goosebumps?", "Why does bread go stale?", "Why do cats purr?", "Why is sea water salty?",
       "Why do leaves change colour in autumn?", "Why do we yawn?",
       "Why does a spoon look bent in a glass of water?", "Why do planes leave white trails in the sky?",
       "Why does metal feel colder than wood at the same temperature?", "Why do we have leap years?",
       "Why does the Moon have phases?", "Why do some people need glasses?", "Why does popcorn pop?",
       "Why do birds migrate?", "Why does hot air rise?", "Why does soap remove grease?",
       "Why do our ears pop on a plane?", "Why do stars twinkle?", "Why do we dream?", "Why does iron rust?",
       "Why can't we tickle ourselves?", "Why do cut apples turn brown?", "Why does thunder follow lightning?",
       "Why do some animals hibernate?", "Why is the ocean blue when a glass of water is clear?",
       "Why does a compass point north?", "Why do we get hiccups?", "Why do rainbows form?",
       "Why do our fingers wrinkle in the bath?", "Why does a balloon stick to a wall after you rub it on your hair?",
       "Why does salt melt ice on roads?", "Why do time zones exist?", "Why does the Earth have seasons?",
       "Why do mosquitoes bite some people more than others?", "Why does a bicycle stay upright when it moves?",
       "Why do we see lightning before we hear thunder?", "Why do boats float even though they are made of steel?",
       "Why does coffee keep people awake?", "Why do we feel dizzy after spinning around?")


def _why(r: Random) -> str:
    q = r.choice(WHY)
    q = r.choice(("", "Quick question: ", "My kid asked me this and I didn't know: ", "Explain like I'm five: ",
                  "Settle a debate for us: ")) + q
    return _register(r, q, 0.1) + r.choice(("", "", " Keep it short.", " Give the scientific explanation, then a "
                                              "simple one.", " Mention a common misconception.", " Use an analogy."))


QUIZ_TOPICS = SCIENCE + EVENTS + SPORTS


def _quiz(r: Random) -> str:
    t, n = r.choice(QUIZ_TOPICS), r.randint(3, 8)
    return r.choice((f"Write {n} multiple-choice quiz questions about {t}, with the answers at the end.",
                     f"Make a {n}-question true-or-false quiz about {t} for a pub quiz night.",
                     f"Create {n} flashcards (question and answer) to help me revise {t}.",
                     f"Write {n} short-answer questions about {t} for a secondary school test, with a marking guide.",
                     f"Test my knowledge: ask me {n} questions about {t}, one at a time, starting with the easiest."))


# ============================================================== practical families

TASKS = ("change a flat bicycle tyre", "unclog a kitchen sink", "iron a shirt", "make a monthly budget spreadsheet",
         "back up the photos on my phone", "remove a red wine stain from a carpet", "descale a kettle",
         "start a vegetable garden on a balcony", "set up a new Wi-Fi router", "sharpen a kitchen knife",
         "brew pour-over coffee", "tie a bowline knot", "hang a heavy picture on a plaster wall", "jump-start a car",
         "clean a cast-iron pan", "fold a fitted sheet", "wrap a present neatly", "bleed a radiator",
         "train a puppy to sit", "repot a houseplant", "take better photos with my phone",
         "ask my phone company for a lower bill", "create a strong password I can remember",
         "memorise a short speech", "read a nutrition label", "cook rice in a pot without a rice cooker",
         "patch a small hole in a wall", "remove rust from garden tools", "pack a suitcase efficiently",
         "check my car's tyre pressure", "meditate for the first time", "make cold brew coffee",
         "set up two-factor authentication", "write a thank-you note", "compost kitchen scraps",
         "paint a room without leaving streaks", "fix a squeaky door hinge", "get rid of fruit flies",
         "keep cut flowers fresh for longer", "boil an egg so the yolk stays soft", "learn to touch-type",
         "wash a wool jumper by hand", "sew a button back on", "defrost a freezer",
         "measure a room for new flooring", "choose a ripe melon", "take a screenshot on a laptop",
         "make a simple web page with HTML", "clean a laptop keyboard safely", "grow herbs on a windowsill",
         "stop my glasses from fogging up", "make my own bread without a machine", "shorten a pair of trousers",
         "find a leak in a bicycle inner tube", "set up a printer on my home network")


def _howto(r: Random) -> str:
    t = r.choice(TASKS)
    text = r.choice((f"How do I {t}?", f"What's the easiest way to {t}?", f"Can you explain how to {t}?",
                     f"I've never done this before: how do I {t}?",
                     f"What tools or materials do I need to {t}, and what do I do with them?",
                     f"What are the most common mistakes people make when they try to {t}?",
                     f"I'm a {r.choice(PROFESSIONS)} with very little free time. What's the quickest way to {t}?",
                     f"My flatmate says there's a trick to {t}. Is there?"))
    return _register(r, text, 0.2) + _fmt(r, 0.3)


LIST_TOPICS = ("ways to save electricity at home", "habits that improve sleep", "board games for a family with young "
               "children", "signs that a houseplant is overwatered", "important inventions of the 20th century",
               "cheap hobbies to try", "ways to make a small room look bigger", "indoor activities for a rainy day",
               "common logical fallacies", "ways to reuse glass jars", "classic novels from the 19th century",
               "careers that involve working outdoors", "mistakes beginners make when learning to cook",
               "benefits of learning a second language", "renewable energy sources", "animals that live in deserts",
               "features of a good user manual", "foods that are high in iron", "simple science experiments for kids",
               "ways to make a presentation more engaging", "team-building games for remote teams",
               "ways to reduce screen time", "essential items for a first-aid kit", "classic films about space",
               "tips for writing clearly", "questions to break the ice at a party", "ways to lower stress during exams",
               "low-maintenance houseplants", "famous bridges and what makes them special",
               "uses for baking soda around the house", "ways cities can reduce traffic",
               "inventions that changed how we communicate", "signs of dehydration",
               "ways to make a website more accessible", "wonders of the ancient world",
               "skills every programmer should learn", "reasons bees matter", "things to check before buying a "
               "used bicycle", "facts about octopuses", "ways to stay warm without turning up the heating",
               "common causes of a slow laptop", "unusual musical instruments", "ways to keep a conversation going",
               "garden plants that attract butterflies", "podcast topic ideas for a history fan",
               "ways to use leftover bread", "famous female scientists", "things to do on a long train journey")


def _list(r: Random) -> str:
    t, n = r.choice(LIST_TOPICS), r.randint(3, 10)
    text = r.choice((f"List {n} {t}.", f"Give me {n} {t}, with one sentence on each.",
                     f"What are {n} {t}? Use bullet points.",
                     f"Name {n} {t} and rank them from most to least useful.",
                     f"I need {n} {t}. Short answers only.", f"Write a numbered list of {n} {t}, each under 12 words.",
                     f"Can you suggest {n} {t} that most people haven't heard of?"))
    return _register(r, text)


PARTIES = ("birthday", "retirement", "end-of-year office", "graduation", "housewarming")


def _brainstorm(r: Random) -> str:
    b, n = r.choice(BUSINESSES), r.randint(3, 10)
    return r.choice((f"Give me {n} name ideas for a {b} in {r.choice(CITIES)}.",
                     f"Brainstorm {n} ways a {b} could attract more customers in winter.",
                     f"What are {n} creative uses for an old {r.choice(OBJECTS)}?",
                     f"Suggest {n} research questions a student could investigate about {r.choice(SCIENCE)}.",
                     f"Come up with {n} fun team names for a {r.choice(SPORTS)} club.",
                     f"Suggest {n} themes for a {r.choice(PARTIES)} party.",
                     f"Brainstorm {n} ideas for a school project about {_plural(r.choice(ANIMALS))}.",
                     f"Give me {n} ideas for a weekend side project that uses {r.choice(LANGUAGES)}."))


PRODUCT_ADJECTIVES = ("lightweight", "foldable", "solar-powered", "waterproof", "budget", "premium", "child-friendly",
                      "eco-friendly", "ultra-quiet", "retro-style", "smart")
CUSTOMERS = ("students", "busy parents", "people who travel a lot", "retired people", "small offices", "campers",
             "people living in small flats", "first-time buyers")


def _product_copy(r: Random) -> str:
    o, b = r.choice(OBJECTS), r.choice(BUSINESSES)
    return r.choice((f"Write a product description (under {r.choice((60, 80, 100, 150))} words) for a "
                     f"{r.choice(PRODUCT_ADJECTIVES)} {o} aimed at {r.choice(CUSTOMERS)}.",
                     f"Write three catchy slogans for a {b} in {r.choice(CITIES)}.",
                     f"Write a social media post announcing a new dish with {r.choice(FOODS)} at our "
                     f"{r.choice(FOOD_BUSINESSES)}.",
                     f"Write a 30-second radio advert script for a {b}.",
                     f"Write the 'About us' paragraph for a small {b} run by a retired {r.choice(PROFESSIONS)}.",
                     f"Write a short, honest product listing for a used {o} in good condition.",
                     f"Write a two-sentence tagline for a {r.choice(PRODUCT_ADJECTIVES)} {o}."))


CLAIMS = ("cities should make public transport free", "schools should teach cooking", "museums should be free to enter",
          "libraries matter more than ever", "people should learn to repair their own clothes",
          "cycle lanes make cities better for everyone", "children should learn to code",
          "companies should try a four-day working week", "everyone should learn basic first aid",
          "handwriting is still worth teaching", "cities should plant more trees", "voting should be made easier",
          "reading fiction makes people more empathetic", "local news deserves public funding",
          "homework should be limited in primary school", "people should eat more plant-based meals",
          "single-use plastics should be banned", "public parks deserve more funding",
          "every student should study a second language", "night trains should make a comeback",
          "people should take regular breaks from social media",
          "old buildings should be renovated rather than demolished", "products should be designed to be repairable",
          "cities should have more public drinking fountains", "space exploration is worth the money",
          "personal finance should be taught in every school", "zoos should focus on conservation",
          "daylight saving time should be abolished", "neighbourhoods need more community gardens",
          "public transport should run all night at weekends")


def _persuasive(r: Random) -> str:
    c = r.choice(CLAIMS)
    return r.choice((f"Write a persuasive paragraph arguing that {c}.",
                     f"Give three strong arguments that {c}, with evidence someone could check.",
                     f"Write a short opinion piece (about 150 words) for a local newspaper arguing that {c}.",
                     f"Argue that {c}, then state the strongest counter-argument and answer it.",
                     f"Write a tweet-length argument that {c}.",
                     f"Write a speech opening (about 80 words) for a student debate, arguing that {c}."))


# ============================================================== language families

REWRITES = ("Rewrite this sentence in a formal tone:", "Make this sound friendlier and more casual:",
            "Rewrite this for a seven-year-old:", "Rewrite this as the opening line of a polite email:",
            "Turn this into a newspaper headline:", "Rewrite this sentence in the passive voice:",
            "Rewrite this in the style of a Victorian novel:", "Make this more concise without losing meaning:",
            "Rephrase this so it sounds more confident:", "Rewrite this as a text message with emojis:",
            "Give three different ways to say this:", "Rewrite this sentence in the past tense:")


def _rewrite(r: Random) -> str:
    ask, s = r.choice(REWRITES), _sentence(r)
    return r.choice((f'{ask} "{s}"', f"{ask}\n\n{s}"))


def _summarise_note(r: Random) -> str:
    ask = r.choice(("Summarise this in one sentence:", "Give this message a short subject line:",
                    "What are the key facts in this text? Use bullet points.",
                    "Shorten this to under 30 words while keeping the important details:",
                    "Turn this note into a to-do list:", "Write a polite reply to this message:",
                    "What questions might a reader still have after reading this?",
                    "Rewrite this text as three short bullet points for a noticeboard:"))
    return f"{ask}\n\n{_note(r)}"


def _grammar(r: Random) -> str:
    s = _corrupt(r, _sentence(r) if r.random() < 0.7 else _note(r))
    ask = r.choice(("Fix the grammar and spelling:", "Proofread this and explain each correction:",
                    "Correct any mistakes in this text, then list what you changed:",
                    "Is this grammatically correct? If not, fix it:", "Please correct my English:"))
    return f"{ask}\n\n{s}"


PHRASES = ("Where is the nearest train station?", "I would like a table for two, please.",
           "Could you speak a little more slowly?", "How much does this cost?", "I am allergic to nuts.",
           "What time does the museum open tomorrow?", "Thank you so much for your help.",
           "I missed my connection. What should I do?", "Is this seat taken?", "Can I pay by card?",
           "The heating in my room is not working.", "We are looking forward to meeting you next week.")


def _translate(r: Random) -> str:
    lang = r.choice(HUMAN_LANGUAGES)
    s = r.choice(PHRASES) if r.random() < 0.35 else _sentence(r)
    return r.choice((f"Translate into {lang}: {s}", f'How would you say "{s}" in {lang}?',
                     f"Translate this sentence into {lang} and explain any tricky words:\n\n{s}",
                     f"Give a natural {lang} translation (not word for word) of:\n\n{s}",
                     f"Translate into {lang}, using a polite register:\n\n{s}"))


POSITIVE = ("works perfectly", "exceeded my expectations", "was worth every penny", "arrived early and well packed",
            "is so easy to use", "still looks brand new after months")
NEGATIVE = ("broke after two days", "is much louder than advertised", "came with missing parts",
            "stopped charging within a week", "feels cheap and flimsy", "was nothing like the photos")
DINING_GOOD = ("the staff were lovely", "the portions were generous", "the dish with {food} was the best I've had")
DINING_BAD = ("we waited an hour for our food", "the dish with {food} arrived cold", "the bill had two mistakes")


PRAISE = ("Would buy again.", "Five stars.", "Highly recommended.", "")
COMPLAINTS = ("Avoid.", "Very disappointed.", "Returning it.", "")


def _review(r: Random) -> str:
    o = r.choice(OBJECTS)
    kind = r.randrange(4)
    if kind == 0:
        return f"The {o} {r.choice(POSITIVE)}. {r.choice(PRAISE)}".strip()
    if kind == 1:
        return f"This {o} {r.choice(NEGATIVE)}. {r.choice(COMPLAINTS)}".strip()
    if kind == 2:
        return f"The {o} {r.choice(POSITIVE)}, but it {r.choice(NEGATIVE)}."
    good = r.choice(DINING_GOOD).format(food=r.choice(FOODS))
    bad = r.choice(DINING_BAD).format(food=r.choice(FOODS))
    return f"We ate at a small restaurant in {r.choice(CITIES)}: {good}, {r.choice(('but', 'although', 'and'))} {bad}."


def _sentiment(r: Random) -> str:
    rev = _review(r)
    return r.choice((f"Classify the sentiment of this review as positive, negative or mixed:\n\n{rev}",
                     f"Is this customer happy? Answer with one word, then explain briefly.\n\n{rev}",
                     f"Rate the sentiment of this review from 1 (very negative) to 5 (very positive) and justify "
                     f"the score:\n\n{rev}",
                     f'Return JSON with the keys "sentiment" and "reason" for this review:\n\n{rev}',
                     f"Write a short, polite reply from the company to this review:\n\n{rev}"))


HEADLINES = {
    "sports": ("{city} side wins {sport} title after dramatic final", "Veteran {sport} star announces retirement",
               "{country} to host next year's {sport} championship"),
    "science": ("Researchers find new clues about {science}", "New telescope data surprises astronomers",
                "Study of {animals} reveals unexpected behaviour"),
    "business": ("Price of {food} climbs as harvests fall short", "{city} start-up raises funds for cheaper {object}",
                 "Local {business} chain to open ten new branches"),
    "technology": ("New {object} design promises longer battery life", "Software update fixes long-standing bug",
                   "{country} launches national digital ID scheme"),
    "culture": ("{city} museum opens exhibition on {event}", "Novel about a lonely {profession} wins major prize",
                "Street musicians return to {city} for summer festival"),
    "health": ("Study links regular {sport} to better sleep", "Doctors warn about rise in {science}-related myths",
               "Hospital in {city} trials shorter waiting lists"),
    "politics": ("{country} parliament debates {policy}", "Mayor of {city} promises cheaper public transport",
                 "Voters in {country} head to the polls on Sunday"),
}


def _headline(r: Random) -> str:
    cat = r.choice(sorted(HEADLINES))
    return r.choice(HEADLINES[cat]).format(city=r.choice(CITIES), sport=r.choice(SPORTS), country=r.choice(COUNTRIES),
                                           science=r.choice(SCIENCE), animal=r.choice(ANIMALS), food=r.choice(FOODS),
                                           object=r.choice(OBJECTS), business=r.choice(BUSINESSES),
                                           event=r.choice(EVENTS), profession=r.choice(PROFESSIONS),
                                           policy=r.choice(POLICIES), animals=_plural(r.choice(ANIMALS)))


def _topic_classify(r: Random) -> str:
    cats = ", ".join(sorted(HEADLINES))
    if r.random() < 0.4:
        lines = "\n".join(f"{i + 1}. {_headline(r)}" for i in range(r.randint(3, 5)))
        return f"Label each headline with one topic ({cats}):\n\n{lines}"
    h = _headline(r)
    return r.choice((f"Which category fits this headline best: {cats}?\n\nHeadline: {h}",
                     f'Classify this news headline into a topic and give a confidence from 0 to 1: "{h}"',
                     f'Write the first paragraph of a news story with this headline: "{h}"',
                     f'Suggest three tags for an article titled "{h}".'))


SURNAMES = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak")


def _extract(r: Random) -> str:
    s = _slots(r)
    age, year, price = r.randint(19, 78), r.randint(1995, 2023), r.randint(5, 90)
    text = r.choice((
        f"{s['name']} is a {age}-year-old {s['profession']} from {s['city']} who spends weekends playing {s['sport']}.",
        f"{s['name']}, {age}, moved from {s['city']} to {s['city2']} in {year} to work as a {s['profession']}.",
        f"The {s['sport']} open day will take place on {s['day']} {r.randint(1, 28)} {s['month']} at the town hall "
        f"in {s['city']}; tickets cost {price} euros and {s['name']} is the contact person.",
        f"Order #{r.randint(1000, 9999)}: 2 x {s['object']}, 1 x bag of {s['food']}. Ship to {s['name']} "
        f"{r.choice(SURNAMES)}, {s['city']}. Paid: {price}.50 EUR.",
        f"Hi, this is {s['name']}. I'd like to book a table for {r.randint(2, 9)} people at 7:30 pm on {s['day']}. "
        f"One of us is allergic to {s['food']}. You can reach me on 555-{r.randint(1000, 9999)}."))
    return r.choice((f"Extract the names, places, dates and numbers from this text as JSON:\n\n{text}",
                     f"Fill in a table with the columns Field | Value using this text:\n\n{text}",
                     f"Pull out every person and place mentioned in this text:\n\n{text}",
                     f"Turn this text into a JSON object with sensible keys:\n\n{text}",
                     f"What information is missing from this text if I want to send a confirmation? {text}"))


SORT_CATEGORIES = {"foods": FOODS, "sports": SPORTS, "animals": ANIMALS, "countries": COUNTRIES, "cities": CITIES,
                   "professions": PROFESSIONS}


def _sort_group(r: Random) -> str:
    kind = r.randrange(5)
    a, b = r.sample(sorted(SORT_CATEGORIES), 2)
    if kind == 0:
        items = r.sample(SORT_CATEGORIES[a], r.randint(5, 9))
        return f"Sort these {a} alphabetically: {', '.join(items)}."
    if kind == 1:
        items = r.sample(SORT_CATEGORIES[a], 3) + r.sample(SORT_CATEGORIES[b], 3)
        r.shuffle(items)
        return f"Group these into two categories and name each category: {', '.join(items)}."
    if kind == 2:
        items = r.sample(SORT_CATEGORIES[a], 4) + [r.choice(SORT_CATEGORIES[b])]
        r.shuffle(items)
        return f"Which is the odd one out, and why? {', '.join(items)}"
    if kind == 3:
        nums = [r.randint(-50, 500) for _ in range(r.randint(6, 10))]
        return r.choice(("Sort these numbers from smallest to largest: ", "Find the median of: ",
                         "Which of these numbers are even? ")) + ", ".join(map(str, nums))
    items = r.sample(SORT_CATEGORIES[a], 4)
    items = items + r.sample(items, 2)
    r.shuffle(items)
    return f"Remove the duplicates from this list and count what is left: {', '.join(items)}."


RHYME_WORDS = ("light", "stone", "river", "dream", "table", "orange", "rain", "heart", "moon", "bread", "clock",
               "sky", "window", "garden", "fire", "silver", "ocean", "winter")
DOMAINS = ("cooking", "the ocean", "music", "space", "sport", "the weather", "school", "travel", "gardening")


def _word_play(r: Random) -> str:
    w, letter = r.choice(RHYME_WORDS), r.choice("BCDFGHLMPRST")
    return r.choice((f"Give five words that rhyme with '{w}'.",
                     f"Make up a tongue twister about a {r.choice(ANIMALS)}.",
                     f"Write a riddle whose answer is '{r.choice(OBJECTS)}'.",
                     f"Give {r.randint(5, 10)} words that start with '{letter}' and are related to "
                     f"{r.choice(DOMAINS)}.",
                     f"Make a pun about {r.choice(FOODS)}.",
                     f"Write a sentence in which every word starts with the letter {letter}.",
                     f"How many syllables are in '{r.choice(WORDS)}'? Split it into syllables.",
                     f"Invent a new word for the feeling of {r.choice(SCENES)}, and define it."))


# ============================================================== creative families

SEASONS = ("spring", "summer", "autumn", "winter")


def _poem(r: Random) -> str:
    return r.choice((f"Write a haiku about {r.choice(SCENES)}.",
                     f"Write a limerick about a {r.choice(PROFESSIONS)} from {r.choice(CITIES)}.",
                     f"Write a four-line rhyming poem about {r.choice(EMOTIONS)}.",
                     f"Write a short free-verse poem from the point of view of a {r.choice(OBJECTS)}.",
                     f"Write an acrostic poem using the word {r.choice(RHYME_WORDS).upper()}.",
                     f"Write a poem about {r.choice(SEASONS)} in {r.choice(CITIES)}, in the style of a nursery rhyme.",
                     f"Write a 14-line poem about {r.choice(SCIENCE)}.",
                     f"Write a short poem about a {r.choice(ANIMALS)} who feels {r.choice(EMOTIONS)}.",
                     f"Write song lyrics (one verse and a chorus) about {r.choice(SCENES)}."))


TWISTS = ("can talk", "shows tomorrow's weather", "belonged to a famous explorer", "has a map hidden inside",
          "only works at midnight", "keeps reappearing on their doorstep", "grants one small wish a day",
          "plays a song nobody recognises")


def _story(r: Random) -> str:
    p, c, o = r.choice(PROFESSIONS), r.choice(CITIES), r.choice(OBJECTS)
    return r.choice((f"Write a short story (about {r.choice((100, 150, 200))} words) about a {p} in {c} who finds a "
                     f"{o} that {r.choice(TWISTS)}.",
                     f"Write the opening paragraph of a mystery set in {c} in {r.choice(SEASONS)}.",
                     f"Write a bedtime story for a five-year-old about a {r.choice(ANIMALS)} who feels "
                     f"{r.choice(EMOTIONS)}.",
                     f"Write a 100-word science-fiction story in which {r.choice(SCIENCE)} plays a central role.",
                     f'Continue this story in about 120 words: "The last bus out of {c} was empty except for a {p} '
                     f'holding a {o}."',
                     f"Write a fable with a moral about {r.choice(EMOTIONS)}, starring a {r.choice(ANIMALS)}.",
                     f"Write a very short story told only through three text messages between a {p} and a "
                     f"{r.choice(PROFESSIONS)}."))


SITUATIONS = ("their first day at a new school", "finishing their first race", "a long-awaited holiday was cancelled",
              "finding an old photo album", "their best friend moved abroad", "getting a surprise parcel",
              "passing a driving test", "losing a favourite scarf", "their team lost the final",
              "seeing snow for the first time", "a power cut on a stormy night", "a stranger returned their wallet")


def _emotion(r: Random) -> str:
    e = r.choice(EMOTIONS)
    return r.choice((f"Describe the feeling of {e} to someone who has never experienced it.",
                     f"Write a diary entry (about 120 words) by someone feeling {e} after {r.choice(SITUATIONS)}.",
                     f"How does {e} usually show in body language and voice?",
                     f"Which colour, sound and smell would you associate with {e}, and why?",
                     f"Write a short scene in which a character shows {e} without the word being used.",
                     f"Why do humans feel {e}? Give a short explanation from psychology.",
                     f"Write a short monologue of someone trying to hide their {e} at a family dinner."))


# ============================================================== maths

def _math_word(r: Random) -> str:
    name, n = r.choice(NAMES), r.randint
    problems = (
        lambda: f"{name} buys {n(2, 9)} notebooks at ${n(2, 7)} each and pays with a $50 note. How much change "
                f"does {name} get?",
        lambda: f"A train leaves {r.choice(CITIES)} at {n(6, 11)}:00 travelling at {n(6, 16) * 10} km/h. How far "
                f"has it gone by {n(12, 17)}:30?",
        lambda: f"A recipe for {n(2, 4)} people needs {n(2, 9) * 50} grams of {r.choice(FOODS)}. How much is needed "
                f"for {n(5, 12)} people?",
        lambda: f"A shop cuts the price of a {r.choice(OBJECTS)} from ${n(40, 400)} by {n(1, 9) * 5}%. What is the "
                f"new price?",
        lambda: f"{name} saves ${n(5, 40)} a week. How many weeks until {name} can afford a {r.choice(OBJECTS)} "
                f"costing ${n(100, 900)}?",
        lambda: f"A rectangular garden is {n(3, 20)} m by {n(4, 30)} m. How much fencing is needed to go round it, "
                f"and what is its area?",
        lambda: f"{name} reads {n(12, 45)} pages a day. The book has {n(180, 640)} pages. After how many days will "
                f"{name} finish it?",
        lambda: f"If {n(2, 6)} workers can paint a house in {n(4, 12)} days, how long would {n(7, 12)} workers take "
                f"at the same rate?",
        lambda: f"A tank holds {n(20, 90) * 10} litres and leaks {n(2, 15)} litres per hour. After how many hours "
                f"is it half empty?",
        lambda: f"The average of {n(3, 6)} test scores is {n(60, 85)}. What score is needed on the next test to "
                f"raise the average by 2 points?",
        lambda: f"A bus has {n(30, 60)} seats. {n(5, 20)} people get on at the first stop, {n(1, 5)} get off at the "
                f"second, and {n(3, 12)} get on. How many seats are still empty?",
        lambda: f"{name} invests ${n(5, 50) * 100} at {n(2, 7)}% simple interest per year. How much interest is "
                f"earned after {n(2, 10)} years?",
        lambda: f"A phone plan costs ${n(10, 30)} a month plus ${n(2, 5)} for each GB over {n(5, 20)} GB. {name} "
                f"used {n(21, 40)} GB. What is the bill?",
        lambda: f"{name} runs {n(3, 12)} km in {n(18, 70)} minutes. What is the average speed in km/h?",
        lambda: f"A class of {n(20, 35)} students is split into groups of {n(3, 6)}. How many full groups are there, "
                f"and how many students are left over?",
    )
    tail = r.choice(("", " Show your working.", " Explain each step.", " Give only the final answer.",
                     " Explain it as if to a twelve-year-old."))
    return r.choice(problems)() + tail


def _math_direct(r: Random) -> str:
    n = r.randint
    a, b = n(2, 30), n(2, 30)
    return r.choice((
        f"What is {n(1, 19) * 5}% of {n(20, 900)}?", f"Solve for x: {a}x + {n(1, 40)} = {n(41, 200)}.",
        f"Convert {n(2, 200)} miles to kilometres.", f"Convert {n(-10, 110)}°F to Celsius.",
        f"What is {n(12, 99)} × {n(12, 99)}? Check your answer by estimating.",
        f"Simplify the fraction {a * n(2, 9)}/{a * n(10, 19)}.",
        f"How many days are there between {n(1, 28)} {r.choice(MONTHS)} and {n(1, 28)} {r.choice(MONTHS)} in the same "
        f"non-leap year?",
        f"Is {n(100, 999)} a prime number? Explain how you checked.",
        f"What is the least common multiple of {a} and {b}?", f"Write {n(11, 3999)} in Roman numerals.",
        f"Round {n(1000, 99999) / 137:.5f} to two decimal places and to the nearest ten.",
        f"Expand (x + {a})(x - {b}).",
        f"Find the mean, median and mode of: {', '.join(str(n(1, 20)) for _ in range(n(6, 9)))}.",
        f"A circle has a radius of {n(2, 25)} cm. What are its circumference and area?",
        f"Convert {n(5, 255)} to binary and to hexadecimal.",
        f"What is the probability of rolling a total of {n(2, 12)} with two six-sided dice?",
        f"If f(x) = {a}x² - {b}x + 1, what is f({n(-5, 5)})?",
        f"A price rises by {n(5, 30)}% and then falls by {n(5, 30)}%. What is the overall percentage change?"))


# ============================================================== code and Python stdlib families

CODING_TASKS = ("checks whether a string is a palindrome, ignoring spaces and punctuation",
                "returns the n-th Fibonacci number without recursion", "merges two sorted lists into one sorted list",
                "counts the words in a text file", "converts a Roman numeral to an integer", "flattens a nested list",
                "groups a list of words by their first letter", "finds the most common element in a list",
                "rotates a square matrix 90 degrees clockwise", "computes a moving average over a list of numbers",
                "removes duplicate lines from a file while keeping their order",
                "returns the longest common prefix of a list of strings", "checks whether two strings are anagrams",
                "implements binary search on a sorted list", "splits a list into chunks of size n",
                "formats a number of seconds as HH:MM:SS", "checks whether a year is a leap year",
                "reverses the order of words in a sentence", "returns the second largest number in a list",
                "retries a function call up to three times when it raises an exception",
                "converts snake_case names to camelCase", "finds all prime numbers below n",
                "computes the edit distance between two strings",
                "simulates rolling two dice 1,000 times and counts each total",
                "truncates a string to n characters and adds an ellipsis",
                "checks whether the brackets in a string are balanced",
                "merges two dictionaries, adding up the values of shared keys",
                "validates that a string looks like an email address", "transposes a list of lists",
                "returns every pair of numbers in a list that sums to a target")


def _symbols() -> list[tuple[str, str, str]]:
    """(module, name, first docstring sentence) for public stdlib functions, in a fixed order."""
    out = []
    for mod_name in API_MODULES:
        mod = _import(mod_name)
        if mod is None:
            continue
        for name in sorted(vars(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            if (getattr(obj, "__module__", None) or "").lstrip("_") != mod_name:  # skip re-exports
                continue
            if (mod_name, name) in PATCHED_BY_IMPORTS:
                continue
            sentence = _first_sentence(inspect.getdoc(obj) or "")
            if sentence and not sentence.startswith(name):
                out.append((mod_name, name, sentence))
    return out


# Stdlib functions that a library replaces when imported (torch swaps in its own ``inspect.getfile``):
# left out always, so the corpus is the same whether or not such a library was imported first.
PATCHED_BY_IMPORTS = frozenset({("inspect", "getfile")})
API_MODULES = ("json", "re", "string", "textwrap", "shutil", "datetime", "random", "heapq", "bisect", "csv",
               "urllib.parse", "difflib", "fractions", "statistics", "math", "itertools", "functools", "collections",
               "operator", "copy", "base64", "html", "calendar", "glob", "fnmatch", "shlex", "tempfile", "uuid",
               "ipaddress", "colorsys", "pprint", "zlib", "binascii", "hashlib", "secrets", "unicodedata", "inspect",
               "contextlib", "dataclasses", "gzip", "zipfile", "email.utils", "mimetypes", "keyword", "warnings",
               "traceback", "cmath", "graphlib", "reprlib", "tokenize", "gettext", "filecmp", "timeit", "quopri")
SNIPPET_MODULES = ("textwrap", "heapq", "bisect", "fnmatch", "shlex", "colorsys", "calendar", "statistics",
                   "fractions", "html", "base64", "urllib.parse", "glob", "reprlib", "string", "copy", "functools",
                   "random", "csv", "gettext", "mimetypes", "pprint", "quopri", "uuid", "graphlib", "tempfile",
                   "email.utils", "posixpath", "filecmp", "keyword")


def _import(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except Exception:  # a trimmed-down Python may lack a module: its family just gets smaller
        return None


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", para)[0]
    ok = 20 <= len(sentence) <= 160 and sentence[0].isupper() and "deprecated" not in sentence.lower()
    return sentence if ok else ""


VERBS = {"Return": "returns", "Compute": "computes", "Convert": "converts", "Create": "creates", "Split": "splits",
         "Make": "makes", "Get": "gets", "Remove": "removes", "Find": "finds", "Test": "tests", "Check": "checks",
         "Decode": "decodes", "Encode": "encodes", "Calculate": "calculates", "Parse": "parses", "Build": "builds",
         "Escape": "escapes", "Format": "formats", "Apply": "applies", "Read": "reads", "Write": "writes",
         "Insert": "inserts", "Produce": "produces", "Generate": "generates", "Join": "joins", "Replace": "replaces",
         "Translate": "translates", "Copy": "copies", "Match": "matches", "Wrap": "wraps", "Fill": "fills",
         "Normalize": "normalizes", "Round": "rounds", "Collapse": "collapses", "Determine": "determines",
         "Construct": "constructs", "Scan": "scans", "Push": "pushes", "Pop": "pops", "Locate": "locates"}


@lru_cache(maxsize=None)
def _stdlib_symbols() -> tuple[tuple[str, str, str], ...]:
    return tuple(_symbols())


def _pick(r: Random, material: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    if not material:
        raise NoMaterial
    return r.choice(material)


def _py_api(r: Random) -> str:
    mod, name, doc = _pick(r, _stdlib_symbols())
    return r.choice((f"Explain what Python's `{mod}.{name}` does and show a short example.",
                     f"When would I use `{mod}.{name}` in Python? Give a realistic use case.",
                     f"What arguments does `{mod}.{name}` take, and what does it return?",
                     f'The Python docs say this about `{mod}.{name}`: "{doc}" Can you explain that in plain English?',
                     f"Write a short, commented code example that uses `{mod}.{name}`.",
                     f"What are the pitfalls or edge cases of `{mod}.{name}`?"))


def _py_write(r: Random) -> str:
    if r.random() < 0.35:
        lang = "Python" if r.random() < 0.5 else r.choice(LANGUAGES)
        return f"Write a {lang} function that {r.choice(CODING_TASKS)}." + r.choice(
            ("", " Include type hints and a docstring.", " Add two example calls.", " Explain its time complexity.",
             " Keep it under 15 lines."))
    mod, name, doc = _pick(r, _stdlib_symbols())
    verb, _, rest = doc.partition(" ")
    if verb in VERBS and rest:
        what = f"{VERBS[verb]} {rest}".rstrip(".")
        return r.choice((f"Write a Python function that {what}.",
                         f"Without importing `{mod}`, write a Python function `{name}` that {what}.",
                         f"Implement from scratch a function that {what}. Add a docstring and one test."))
    return f'Without importing `{mod}`, implement `{name}` in plain Python. Its documentation says: "{doc}"'


def _function_snippets() -> list[tuple[str, str]]:
    """(module, source) of short stdlib functions without docstrings, in a fixed order."""
    out = []
    for mod_name in SNIPPET_MODULES:
        mod = _import(mod_name)
        try:
            tree = ast.parse(inspect.getsource(mod))  # type: ignore[arg-type]
        except Exception:  # no source (frozen / compiled-only install): skip the module
            continue
        nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            nodes += [n for n in cls.body if isinstance(n, ast.FunctionDef)]
        for node in nodes:
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # drop the docstring: the model should read the code
            if not body or node.name.startswith("__"):
                continue
            node.body, node.decorator_list = body, []
            code = ast.unparse(node)
            if 4 <= code.count("\n") + 1 <= 14 and len(code) <= SNIPPET_CHARS:
                out.append((mod_name, code))
    return out


@lru_cache(maxsize=None)
def _snippets() -> tuple[tuple[str, str], ...]:
    return tuple(_function_snippets())


def _code_explain(r: Random) -> str:
    mod, code = _pick(r, _snippets()[0::2])
    ask = r.choice((f"What does this function from Python's `{mod}` module do?", "What does this code do?",
                    "Explain this Python function line by line.",
                    "Describe what this function returns, with an example input and output.",
                    "Give this function a one-line docstring.",
                    "Explain this code to someone who knows another language but not Python."))
    return f"{ask}\n\n```python\n{code}\n```"


def _code_review(r: Random) -> str:
    mod, code = _pick(r, _snippets()[1::2])
    ask = r.choice(("Review this Python function. Point out possible bugs, unclear names or edge cases.",
                    "Write three pytest tests for this function.", "Add type hints and a docstring to this function.",
                    "Rewrite this function to be easier to read, keeping its behaviour.",
                    "What inputs could make this function raise an exception?",
                    f"Translate this Python function into {r.choice(LANGUAGES[1:])}."))
    return f"{ask}\n\n```python\n{code}\n```"


def _programming_concept(r: Random) -> str:
    c, lang = r.choice(PROGRAMMING), r.choice(LANGUAGES)
    text = r.choice((f"Explain {c} with a short {lang} example.", f"What problem does {c} solve?",
                     f"I keep hearing about {c} at work. What is it, in plain terms?",
                     f"What are common mistakes beginners make with {c}?",
                     f"Give an interview question about {c} and a model answer.",
                     f"Explain {c} in under 80 words, then give an example in {lang}.",
                     f"How would you teach {c} to a junior developer on their first week?"))
    return _register(r, text)


@lru_cache(maxsize=None)
def _doc_excerpts() -> tuple[tuple[str, str], ...]:
    """(topic, prose excerpt of at most SNIPPET_CHARS) from ``pydoc_data.topics``, a few per topic."""
    topics = getattr(_import("pydoc_data.topics"), "topics", {})
    out = []
    for key in sorted(topics):
        paras = [" ".join(p.split()) for p in topics[key].split("\n\n")
                 if p.strip() and not p.startswith((" ", "[")) and "::=" not in p
                 and not re.search(r"\n[*=\-]{3,}", p) and p.rstrip().endswith((".", ":")) and len(p.split()) >= 8]
        starts = 0
        for i in range(len(paras)):
            if not paras[i][:1].isupper():  # continues a code example we dropped
                continue
            text = ""
            for p in paras[i:]:
                if len(text) + len(p) + 1 > SNIPPET_CHARS:
                    break
                text = f"{text} {p}".strip()
            if len(text) >= 150:
                out.append((key, text))
                starts += 1
            if starts == 3:
                break
    return tuple(out)


def _doc_summary(r: Random) -> str:
    _, text = _pick(r, _doc_excerpts())
    ask = r.choice(("Summarise this Python documentation in three bullet points:",
                    "Explain this excerpt from the Python reference to a beginner:",
                    "What is the key rule described here? Give a short code example.",
                    "Write two quiz questions, with answers, based on this text:",
                    "Rewrite this documentation in plain, friendly language:",
                    "Give this passage a title and list its main terms:"))
    return f"{ask}\n\n{text}"


def _table_json(r: Random) -> str:
    n = r.randint(3, 8)
    tables = ((f"{n} countries", "name, capital, main language"), (f"{n} kitchen herbs", "name, flavour, typical dish"),
              (f"{n} programming languages", "name, year released, typical use"),
              (f"{n} musical instruments", "name, family, country of origin"),
              (f"{n} planets of the solar system", "name, distance from the Sun, number of moons"),
              (f"{n} famous inventions", "invention, inventor, year"),
              (f"{n} dog breeds", "breed, size, energy level"), (f"{n} board games", "name, players, playing time"))
    what, cols = r.choice(tables)
    items = ", ".join(f"{r.randint(1, 6)} {f}" for f in r.sample(FOODS, r.randint(3, 6)))
    names = ", ".join(r.sample(NAMES, r.randint(3, 5)))
    return r.choice((f"Create a markdown table of {what} with the columns: {cols}.",
                     f"Return a JSON array describing {what}; each object should have the keys {cols}.",
                     f"Turn this shopping list into a JSON array of objects with 'item' and 'quantity': {items}.",
                     f"Make a weekly chore chart as a markdown table for {names}.",
                     f"Give me a CSV with a header row listing {what} ({cols}).",
                     f"Create a table of {n} {r.choice(('foods', 'sports', 'animals'))} with one fun fact each."))


# ============================================================== held-out families (their own subjects)

HELDOUT_PAIRS = (("renting a home", "buying a home"), ("trains", "planes for trips of about 500 km"),
                 ("e-readers", "printed books"), ("working from home", "working in an office"),
                 ("learning an instrument as a child", "learning one as an adult"),
                 ("electric scooters", "bicycles for commuting"), ("city life", "village life"),
                 ("cats", "dogs as pets"), ("state schools", "homeschooling"), ("paper notebooks", "note-taking apps"),
                 ("travelling alone", "group tours"), ("podcasts", "audiobooks"),
                 ("team sports", "individual sports for teenagers"), ("online courses", "classroom courses"),
                 ("early risers", "night owls"), ("handwritten letters", "emails"),
                 ("studying abroad", "studying in your home country"), ("fresh vegetables", "frozen vegetables"),
                 ("a gap year", "going straight to university"), ("shopping locally", "shopping online"),
                 ("camping", "staying in hotels"), ("meeting in person", "video calls"),
                 ("streaming music", "collecting vinyl records"), ("taking the bus", "driving in a big city"),
                 ("a large university", "a small college"), ("tap water", "bottled water"),
                 ("paper maps", "navigation apps"), ("the mountains", "the seaside for a family holiday"),
                 ("classical music", "jazz"), ("saving money", "paying off debt first"))
HELDOUT_RECIPIENTS = ("my younger brother", "a close friend", "my niece", "a new colleague", "a former student",
                      "my neighbour", "my teenage cousin", "an old school friend", "my daughter", "a pen pal")
HELDOUT_SITUATIONS = ("is starting university in another country", "has just lost their job",
                      "is nervous about giving a speech at a wedding", "wants to quit a steady job to start a business",
                      "is finding it hard to make friends after moving", "is about to become a parent",
                      "keeps arguing with their flatmate", "has failed an important exam",
                      "is retiring after forty years at the same company", "has been offered a promotion abroad",
                      "feels overwhelmed by too many commitments", "is starting their first job as a manager",
                      "wants to reconnect with an estranged sibling", "is adopting a rescue dog",
                      "is worried about travelling abroad alone for the first time",
                      "received harsh criticism at work", "wants to save for a deposit on a flat",
                      "is caring for an elderly parent", "is thinking of dropping out of college",
                      "has been asked to give up a hobby they love")
HELDOUT_ROLES = ("a ship's captain in 1850 talking to a nervous passenger during a storm",
                 "a museum guide at a dinosaur exhibition speaking to a school group",
                 "a medieval blacksmith explaining your work to a time traveller",
                 "a customer support agent for a hotel on the Moon",
                 "a detective questioning a witness about a missing painting",
                 "a friendly robot that has just arrived on Earth",
                 "a lighthouse keeper greeting the first visitor in a month",
                 "a chess coach talking to a student who has just lost a game",
                 "a cook preparing a banquet in ancient Rome", "a mountain guide briefing hikers before a climb",
                 "a guide leading a night walk through an old town", "a radio host taking calls about a strange noise",
                 "a head gardener at a royal palace training an apprentice", "a historian visiting from the year 2400",
                 "a shopkeeper in a magic shop where nothing works as expected",
                 "an old clockmaker with a new apprentice",
                 "a train conductor on the last night train of the season", "a famous chess-playing parrot")
HELDOUT_LINES = ("Is it safe to continue?", "What is the most surprising thing you've seen?", "Why should I trust you?",
                 "Can you tell me a secret about this place?", "I think I'm lost. What should I do?",
                 "What happened here yesterday?", "How did you end up doing this?", "What would you do in my place?")
HELDOUT_GOALS = ("learn to swim as an adult", "prepare for a 10 km charity run",
                 "organise a neighbourhood street party",
                 "move house with two small children", "learn enough Portuguese for a holiday",
                 "declutter an entire flat", "write the first draft of a novel",
                 "launch a small online shop selling handmade candles", "renovate a small bathroom on a budget",
                 "prepare for a driving theory test", "build an emergency savings fund", "start a book club at work",
                 "train for a long-distance hike", "organise a wedding for fifty guests",
                 "learn the basics of woodworking", "set up a home recording studio", "organise a school science fair",
                 "switch careers into web development", "prepare a garden for spring", "run a charity bake sale",
                 "throw a surprise 60th birthday party", "learn to juggle", "set up a community tool library",
                 "cut a household's energy bill", "get fit enough to cycle to work every day")
HELDOUT_TIMEFRAMES = ("in four weeks", "over three months", "in six months", "by the end of the year", "in ten days",
                      "over the next eight weeks")
HELDOUT_SERVICES = ("a self-storage company", "a veterinary clinic", "a car-sharing service",
                    "a public library's e-book lending", "a community swimming pool", "an online piano course",
                    "a bike-sharing scheme", "a dental practice", "a city recycling programme",
                    "a language exchange meetup", "a co-op grocery store", "a youth football league", "a hostel",
                    "a meal-kit delivery service", "a window-cleaning company", "a parcel locker network",
                    "a tenants' association", "a children's summer camp", "a museum membership scheme",
                    "a removals company", "a ferry service", "a wedding photographer", "an evening class programme",
                    "an allotment association")
HELDOUT_QUESTIONS = ("Can I cancel or change my booking?", "What happens if I'm late?",
                     "Do you offer discounts for students or pensioners?", "How do I pay?", "Is there parking nearby?",
                     "What should I bring on my first visit?", "How is my personal data used?", "Can I bring a friend?",
                     "Is it accessible for wheelchair users?", "What if I'm not satisfied?",
                     "How far in advance should I book?", "Do you operate on public holidays?")
HELDOUT_JOBS = ("a night-shift bakery supervisor", "a hospital porter", "a theatre stage manager", "a ski instructor",
                "a ferry deckhand", "a wedding planner", "a supermarket shift leader", "a school bus driver",
                "a hotel receptionist", "a call-centre team lead", "a warehouse picker", "a lifeguard",
                "a dog groomer", "a cinema projectionist", "a gardener for a city council")

HELDOUT_SUBJECTS: dict[str, tuple[str, ...]] = {
    "pairs": tuple(x for pair in HELDOUT_PAIRS for x in pair), "recipients": HELDOUT_RECIPIENTS,
    "situations": HELDOUT_SITUATIONS, "roles": HELDOUT_ROLES, "goals": HELDOUT_GOALS, "services": HELDOUT_SERVICES,
    "jobs": HELDOUT_JOBS,
}


HEADINGS = ("Cost, Convenience and Long-term impact", "Practicality, Enjoyment and Drawbacks",
            "Who it suits, What it costs and What you give up")


def _compare_essay(r: Random) -> str:
    a, b = r.choice(HELDOUT_PAIRS)
    return r.choice((f"Write a short essay comparing {a} and {b}.",
                     f"Compare {a} with {b}: similarities, differences and who each suits best. About 250 words.",
                     f"Write a balanced comparison of {a} and {b} for a student magazine, with a short conclusion.",
                     f"Which is better, {a} or {b}? Discuss both sides before giving your verdict.",
                     f"Compare {a} and {b} under the headings {r.choice(HEADINGS)}."))


def _advice_letter(r: Random) -> str:
    who, sit = r.choice(HELDOUT_RECIPIENTS), r.choice(HELDOUT_SITUATIONS)
    return r.choice((f"Write a warm letter of advice to {who}, who {sit}.",
                     f"Write a letter to {who}, who {sit}, with practical advice and encouragement. Sign it as an "
                     f"older sibling.",
                     f"Draft a letter of advice (under 250 words) to {who}, who {sit}.",
                     f"Write a letter from a grandparent to a grandchild who {sit}, sharing lessons from a similar "
                     f"experience.",
                     f"{who[0].upper() + who[1:]} {sit}. Write them a thoughtful letter with three pieces of advice."))


def _roleplay(r: Random) -> str:
    role, line = r.choice(HELDOUT_ROLES), r.choice(HELDOUT_LINES)
    return r.choice((f'You are {role}. Stay in character and reply to: "{line}"',
                     f"Write a dialogue of about ten lines in which you play {role}.",
                     f'Let\'s role-play. You are {role}. I\'ll start: "{line}"',
                     f"Write a short two-person script featuring {role}, ending with a surprise.",
                     f'Pretend to be {role}. Answer my question in character, in under 100 words: "{line}"'))


def _step_plan(r: Random) -> str:
    g, t = r.choice(HELDOUT_GOALS), r.choice(HELDOUT_TIMEFRAMES)
    return r.choice((f"Create a step-by-step plan to {g} {t}.",
                     f"I want to {g} {t}. Break it into weekly steps with a checklist.",
                     f"Make a detailed plan to {g} {t}, including milestones and what could go wrong.",
                     f"Give me a phased plan (preparation, doing, review) to {g} {t}.",
                     f"Write a day-by-day schedule for the first week of a plan to {g}.",
                     f"What are the steps, in order, to {g} {t}? Include a rough budget."))


def _faq(r: Random) -> str:
    s, q = r.choice(HELDOUT_SERVICES), r.choice(HELDOUT_QUESTIONS)
    return r.choice((f'You write the FAQ page for {s}. Answer this customer question clearly and kindly: "{q}"',
                     f'Write the answer to the FAQ "{q}" for {s}. Keep it under 80 words.',
                     f"Write an FAQ section for {s} with {r.randint(4, 8)} questions and short answers.",
                     f'A visitor to the website of {s} asks: "{q}" Write the FAQ answer, with one practical tip.',
                     f'Write a friendly FAQ answer for {s} to "{q}", then a one-line version for a sign.'))


def _interview(r: Random) -> str:
    job = r.choice(HELDOUT_JOBS)
    return r.choice((f"Write {r.randint(5, 10)} interview questions for {job}, with what a good answer shows.",
                     f"I'm interviewing for a job as {job}. How should I answer 'Tell me about yourself'?",
                     f"Write a mock interview (questions and strong answers) for a role as {job}.",
                     f"What are the toughest interview questions for {job}, and how should I answer them?",
                     f"Give me a sample answer to 'Describe a difficult situation at work' from {job}."))


# ============================================================== registry and public API

TRAIN_FAMILIES: tuple[tuple[str, Maker], ...] = (
    ("explain_science", _explain_science), ("howto", _howto), ("rewrite", _rewrite), ("py_api", _py_api),
    ("math_word", _math_word), ("poem", _poem), ("sentiment", _sentiment), ("list", _list), ("history", _history),
    ("code_explain", _code_explain), ("translate", _translate), ("story", _story), ("why", _why),
    ("explain_society", _explain_society), ("grammar", _grammar), ("py_write", _py_write),
    ("math_direct", _math_direct), ("geography", _geography), ("topic_classify", _topic_classify),
    ("product_copy", _product_copy), ("object_works", _object_works), ("code_review", _code_review),
    ("summarise_note", _summarise_note), ("define_word", _define_word), ("brainstorm", _brainstorm),
    ("food", _food), ("extract", _extract), ("programming_concept", _programming_concept),
    ("emotion", _emotion), ("sports", _sports), ("doc_summary", _doc_summary), ("sort_group", _sort_group),
    ("profession", _profession), ("persuasive", _persuasive), ("table_json", _table_json),
    ("word_play", _word_play), ("quiz", _quiz),
)
HELDOUT_FAMILIES: tuple[tuple[str, Maker], ...] = (
    ("compare_essay", _compare_essay), ("advice_letter", _advice_letter), ("roleplay", _roleplay),
    ("step_plan", _step_plan), ("faq", _faq), ("interview", _interview),
)


def families(split: str) -> tuple[Family, ...]:
    _check_split(split)
    if split in ("train", "extra"):
        size = TRAIN_PER_FAMILY if split == "train" else EXTRA_PER_FAMILY
        return tuple(Family(n, split, m, size) for n, m in TRAIN_FAMILIES)
    size = HELDOUT_PER_FAMILY if split == "heldout" else TEST_PER_FAMILY
    return tuple(Family(n, split, m, size) for n, m in HELDOUT_FAMILIES)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown chat corpus split '{split}' (splits: {', '.join(SPLITS)})")


VERBATIM_FAMILIES = frozenset({"py_api", "py_write", "code_explain", "code_review", "doc_summary"})  # quote sources


def _draw(family: Family, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Up to ``family.size`` distinct prompts of one family, from its own fixed random stream; prompts
    whose normalised text is in ``exclude`` are skipped (drawn, not counted)."""
    r = Random(f"{SEED}:{family.split}:{family.name}")
    seen: set[str] = set()
    out: list[str] = []
    try:
        for _ in range(family.size * 40):
            if len(out) == family.size:
                break
            text = family.make(r).strip()
            text = text if family.name in VERBATIM_FAMILIES else _articles(text)
            key = _norm(text)
            if MIN_CHARS <= len(text) <= MAX_CHARS and key not in seen and key not in exclude:
                seen.add(key)
                out.append(text)
    except NoMaterial:  # a Python without these stdlib sources: the family is left out
        return []
    return out


@lru_cache(maxsize=None)
def chat_prompts(split: str) -> tuple[ChatPrompt, ...]:
    """Every prompt of ``split``, families interleaved round-robin (so any prefix is varied)."""
    _check_split(split)
    # extra draws from the train families' subjects with other random streams, never a train prompt again;
    # test from the held-out families' with other streams, never a held-out prompt again
    before = {"extra": "train", "test": "heldout"}.get(split)
    seen: set[str] = {_norm(p.text) for p in chat_prompts(before)} if before else set()
    exclude = frozenset(seen) if split == "test" else frozenset()  # (extra keeps the draws it was frozen with)
    drawn = [(f.name, _draw(f, exclude)) for f in families(split)]
    columns: list[list[ChatPrompt]] = []
    for name, texts in drawn:  # dedupe across families too, keeping the earlier family's copy
        col = []
        for text in texts:
            if _norm(text) not in seen:
                seen.add(_norm(text))
                col.append(ChatPrompt(name, len(col), text))
        columns.append(col)
    out = []
    for i in range(max((len(c) for c in columns), default=0)):
        out += [c[i] for c in columns if i < len(c)]
    return tuple(out)


def family_counts(split: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in chat_prompts(split):
        counts[p.family] = counts.get(p.family, 0) + 1
    return counts


CORPUS_DIR = Path(__file__).resolve().parents[1] / "headway" / "data" / "corpora"
TEST_FILE = "chat-test.jsonl.gz"


def _gzip_rows(splits: Sequence[str]) -> tuple[bytes, bytes, list[dict[str, str]]]:
    """(gzip'd JSON lines, the uncompressed text, the rows) of ``splits``, each in its round-robin
    order; gzip mtime 0, so the bytes depend only on the prompts."""
    rows = [{"id": p.id(split), "split": split, "family": p.family, "prompt": p.text}
            for split in splits for p in chat_prompts(split)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    return gzip.compress(text, compresslevel=9, mtime=0), text, rows


def frozen_test_bytes() -> tuple[bytes, dict[str, object]]:
    """The test split's file (``chat-test.jsonl.gz``, rows as in the main file) and its manifest entry."""
    data, text, rows = _gzip_rows(("test",))
    return data, {"file": TEST_FILE, "sha256": hashlib.sha256(data).hexdigest(),
                  "content_sha256": hashlib.sha256(text).hexdigest(), "count": len(rows),
                  "families": sorted({r["family"] for r in rows})}


def frozen_bytes() -> tuple[bytes, dict[str, object]]:
    """The corpus as the package ships it: gzip'd JSON lines (``id``, ``split``, ``family``,
    ``prompt``; train, extra, then heldout), and its manifest (checksum, counts, the dev tail, the
    test split's own file, provenance)."""
    data, text, rows = _gzip_rows(MAIN_SPLITS)
    manifest = {"file": "chat.jsonl.gz", "sha256": hashlib.sha256(data).hexdigest(),  # what headway checks
                "content_sha256": hashlib.sha256(text).hexdigest(),  # the prompts (another zlib may compress differently)
                "splits": {s: sum(r["split"] == s for r in rows) for s in MAIN_SPLITS},
                "dev": {"split": "heldout", "last": DEV_PROMPTS}, "test": frozen_test_bytes()[1], "seed": SEED,
                "generator": "tools/chat_corpus.py", "python": platform.python_version()}
    return data, manifest


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="freeze the built-in chat corpus into the package")
    ap.add_argument("--out", type=Path, default=CORPUS_DIR, help="folder for chat.jsonl.gz and chat.json")
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    args = ap.parse_args(argv)
    data, manifest = frozen_bytes()
    if args.check:
        shipped = json.loads((args.out / "chat.json").read_text(encoding="utf-8"))
        same = shipped["content_sha256"] == manifest["content_sha256"] and \
            (shipped.get("test") or {}).get("content_sha256") == manifest["test"]["content_sha256"]
        print(f"{'same prompts as' if same else 'DIFFERS from'} the shipped corpus (content sha256 "
              f"{manifest['content_sha256'][:16]} here, {shipped['content_sha256'][:16]} shipped, frozen on Python "
              f"{shipped['python']})")
        return 0 if same else 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chat.jsonl.gz").write_bytes(data)
    (args.out / TEST_FILE).write_bytes(frozen_test_bytes()[0])
    (args.out / "chat.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'chat.jsonl.gz'} ({len(data):,} bytes, sha256 {manifest['sha256']}): {manifest['splits']}; "
          f"{args.out / TEST_FILE}: test {manifest['test']['count']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
