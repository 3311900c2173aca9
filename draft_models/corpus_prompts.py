"""User messages for the default model's distillation corpus: tens of thousands, written here.

`chat_prompts.py` gives the first draft's ~1.7k questions; this module widens the same idea to a
pool of more than 20k distinct first-turn messages (`message_pool()`), in the kinds people send a
small chat model: explanations, how-tos, code in several languages, lists, comparisons, writing,
rewriting and summarising a given text, maths word problems, advice, trivia. A message is a
question template filled with a subject of its kind and, for some, a style request ("as a
numbered list", "in detail", "in one sentence") that changes the reply's shape and length.
`follow_up(index)` gives the second user turn of a two-turn chat (the target's own first reply
in context).

The pool is a fixed, seeded shuffle, so shard k of the corpus always holds the same messages on
every machine. Nothing here names a subject of `chat_prompts.HELD_OUT_PROMPTS`:
`HELD_OUT_WORDS` lists their key words and the tests check the pool never uses them.
"""

from __future__ import annotations

import functools
import itertools
import random

from .chat_prompts import (
    ANIMALS,
    CODE_TASKS,
    CONCEPTS,
    COUNTRIES,
    HELD_OUT_PROMPTS,
    LANGUAGES,
    PAIRS,
    TASKS,
    WRITING_SUBJECTS,
)

MORE_CONCEPTS = [
    "entropy", "the Doppler effect", "osmosis", "mitosis", "natural selection", "genetics",
    "the nervous system", "the digestive system", "hormones", "allergies", "inflation rates",
    "interest rates", "unemployment", "globalization", "the gig economy", "cryptocurrency",
    "supply chains", "minimalism", "stoicism", "existentialism", "utilitarianism", "game theory",
    "probability", "statistics", "calculus", "algebra", "geometry", "logarithms", "fractions",
    "percentages", "the scientific method", "peer review", "critical thinking", "memory",
    "habits", "motivation", "procrastination", "emotional intelligence", "leadership",
    "teamwork", "time management", "public speaking", "negotiation", "marketing", "branding",
    "customer service", "project management", "agile development", "version control",
    "unit testing", "code review", "technical debt", "microservices", "containers",
    "virtual machines", "compilers", "interpreters", "garbage collection", "memory leaks",
    "APIs", "REST", "GraphQL", "web browsers", "search engines", "social media", "email",
    "Wi-Fi", "Bluetooth", "GPS", "5G networks", "solar panels", "wind turbines",
    "electric cars", "batteries", "hydrogen fuel", "3D printing", "robotics", "drones",
    "self-driving cars", "virtual reality", "augmented reality", "the cloud", "big data",
    "data privacy", "cybersecurity", "phishing", "passwords", "two-factor authentication",
    "the Silk Road trade", "the Ottoman Empire", "the Aztecs", "the Maya", "the Vikings",
    "ancient Greece", "ancient Rome", "the Middle Ages", "feudalism", "the Reformation",
    "the Enlightenment", "the American Revolution", "colonialism", "the space race",
    "the Apollo program", "the International Space Station", "Mars exploration",
    "comets and meteors",
    "the Milky Way", "neutron stars", "supernovas", "the speed of light", "atoms",
    "electrons", "photons", "friction", "momentum", "energy conservation", "heat transfer",
    "the greenhouse effect", "ocean currents", "the carbon cycle", "biodiversity",
    "pollination", "food chains", "soil erosion", "deforestation", "urbanization",
    "public transport", "architecture", "impressionism", "jazz", "classical music", "opera",
    "poetry", "mythology", "folk tales", "the Olympic Games", "chess", "origami", "yoga",
    "marathon training", "strength training", "hydration", "vitamins", "protein",
    "fermentation", "coffee roasting", "tea culture", "wine making", "cheese making",
]
MORE_TASKS = [
    "learn to cook", "meal prep for a week", "build a habit", "stop procrastinating",
    "learn to code", "get better at math", "write clearly", "learn to type faster",
    "decorate a small apartment", "move to a new city", "host a dinner party",
    "plan a birthday party", "choose a laptop", "buy a used car", "fix a leaky faucet",
    "paint a room", "start journaling", "learn photography", "grow tomatoes",
    "compost at home", "reduce my screen time", "learn chess", "memorize a speech",
    "prepare for a marathon", "stretch before exercise", "care for a cat",
    "teach a child to read", "write a thank-you note", "ask for a promotion",
    "handle a difficult coworker", "give constructive feedback", "run a meeting",
    "write a business plan", "price my freelance work", "build a personal website",
    "learn a new skill quickly", "keep a conversation going", "say no politely",
    "travel on a budget", "pack light for a trip", "avoid jet lag", "learn to meditate",
    "improve my posture", "drink more water", "cut down on sugar", "save for retirement",
    "pay off debt", "start investing", "write a poem", "learn to sing", "improve my memory",
]
MORE_CODE_TASKS = [
    "read a JSON file", "write unit tests", "sort numbers", "reverse a list",
    "find duplicates in an array", "count the vowels in a string", "swap two variables",
    "calculate the average of a list", "find the second largest number",
    "check if two strings are anagrams", "capitalize every word", "remove whitespace",
    "convert Celsius to Fahrenheit", "implement binary search", "implement bubble sort",
    "implement a stack", "implement a queue", "build a linked list", "read user input",
    "format a date", "measure how long code takes", "use a while loop", "use a set",
    "filter a list", "map a function over a list", "read environment variables",
    "parse command-line arguments", "write a simple web server", "connect to a database",
    "hash a password", "download a file", "use regular expressions", "create a 2D array",
    "transpose a matrix", "count characters in a string", "find the GCD of two numbers",
]
MORE_LANGUAGES = ["TypeScript", "C++", "C#", "Ruby", "PHP", "Kotlin", "Swift"]
MORE_COUNTRIES = [
    "China", "Russia", "Nigeria", "Indonesia", "Pakistan", "Colombia", "Portugal", "Netherlands",
    "Belgium", "Switzerland", "Austria", "Denmark", "Finland", "Iceland", "New Zealand",
    "Singapore", "Malaysia", "the Philippines", "Cuba", "Jamaica", "Ghana", "Ethiopia",
    "Tanzania", "South Africa", "Saudi Arabia", "Iran", "Israel", "Jordan", "Nepal",
    "Mongolia", "Ukraine", "Hungary", "Czechia", "Romania", "Croatia", "Scotland",
]
MORE_WRITING_SUBJECTS = [
    "a summer storm", "an old photograph", "a train ride", "a forgotten key", "the desert",
    "a snowy village", "a kind stranger", "a broken clock", "the sea at dawn", "a small boat",
    "a city park", "a grandmother's kitchen", "a paper kite", "a lonely astronaut",
    "a secret door", "a treasure map", "a talking tree", "a busy café", "the last leaf",
    "a new beginning", "a quiet evening", "a hidden island", "a letter never sent",
]
MORE_ANIMALS = [
    "lions", "giraffes", "kangaroos", "koalas", "pandas", "polar bears", "camels", "zebras",
    "parrots", "crows", "hummingbirds", "salmon", "jellyfish", "turtles", "snakes", "lizards",
    "spiders", "rabbits", "hedgehogs", "foxes", "deer", "gorillas", "chimpanzees", "squirrels",
]
MORE_PAIRS = [
    ("a lake", "a pond"), ("a hurricane", "a typhoon"), ("a frog", "a toad"),
    ("a rabbit", "a hare"), ("SQL", "NoSQL databases"), ("a compiler", "an interpreter"),
    ("a process", "a thread"), ("Git", "GitHub"), ("a loan", "a lease"),
    ("a debit card", "a credit card"), ("socialism", "capitalism"), ("an embargo", "a tariff"),
    ("a meteor", "a meteorite"), ("an ocean", "a sea"), ("a mountain", "a hill"),
    ("weightlifting", "cardio"), ("a violin", "a viola"), ("a poem", "a song"),
    ("empathy", "sympathy"), ("affect", "effect"), ("a class", "an object"),
    ("a stack", "a queue"), ("machine learning", "deep learning"), ("AM radio", "FM radio"),
]
PERSONS = [
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Charles Darwin", "Ada Lovelace",
    "Alan Turing", "Nikola Tesla", "Galileo Galilei", "William Shakespeare", "Jane Austen",
    "Mahatma Gandhi", "Nelson Mandela", "Cleopatra", "Julius Caesar", "Napoleon Bonaparte",
    "Abraham Lincoln", "Martin Luther King Jr.", "Frida Kahlo", "Vincent van Gogh",
    "Wolfgang Amadeus Mozart", "Ludwig van Beethoven", "Confucius", "Aristotle", "Plato",
    "Socrates", "Genghis Khan", "Queen Victoria", "Rosalind Franklin", "Grace Hopper",
    "Johannes Gutenberg", "Thomas Edison", "the Wright brothers", "Amelia Earhart",
]
TEXTS = [
    "The meeting has been moved to Thursday at 3 pm because the projector in room B is broken.",
    "Our store will be closed on Monday for inventory. Thank you for your patience.",
    "I think that we should maybe consider looking into the possibility of changing vendors.",
    "The new library opens next week with a reading room, a café and free Wi-Fi for everyone.",
    "Thank you for your order. Your package will arrive in three to five business days.",
    "Running every morning helped me sleep better, feel calmer and focus more at work.",
    "the quick brown fox jumps over the lazy dog and then runs into the forest",
    "Please remember to bring your laptop, your charger and a notebook to the workshop.",
    "Due to heavy rain, the football match has been postponed until further notice.",
    "Our team finished the project two weeks early and under budget.",
    "I am writing to ask whether the position of junior designer is still open.",
    "The museum offers free guided tours every Saturday at ten in the morning.",
    "Water boils at 100 degrees Celsius at sea level, but at a lower temperature on mountains.",
    "Cats sleep for around fifteen hours a day, mostly during daylight.",
]
TEXT_TEMPLATES = [
    "Summarize this in one sentence: {x}", "Rewrite this more formally: {x}",
    "Rewrite this in a friendly tone: {x}", "Translate this into French: {x}",
    "Translate this into Spanish: {x}", "Fix the grammar and punctuation: {x}",
    "Make this shorter: {x}", "Turn this into a bulleted list: {x}",
    "What is the main point of this text? {x}", "Write a reply to this message: {x}",
]
NUMBERS = [3, 4, 5, 6, 7, 8, 9, 12, 15, 18, 20, 24, 25, 30, 36, 42, 48, 50, 64, 75, 99, 120]
MATH_TEMPLATES = [
    "What is {a} times {b}?", "What is {a} plus {b}?", "What is {a} percent of {b}?",
    "If I have {a} apples and buy {b} more, how many do I have?",
    "A train travels {a} km in {b} minutes. What is its speed in km per hour?",
    "Is {a} a prime number? Explain why.", "What is the square root of {c}?",
    "If a shirt costs {b} dollars and is {a} percent off, what is the new price?",
    "Split {b} dollars equally between {a} people. How much does each get?",
    "Convert {a} kilometers to miles.", "How many minutes are in {a} hours?",
]

# Templates: (text, the kind of subject it takes).
FIRST_TURN_TEMPLATES = [
    ("Explain {c}.", "c"), ("What is {c} and why does it matter?", "c"),
    ("How does {c} work?", "c"), ("Tell me about {c}.", "c"),
    ("What are the pros and cons of {c}?", "c"), ("What are common misconceptions about {c}?", "c"),
    ("How would you teach {c} to a beginner?", "c"), ("What is the history of {c}?", "c"),
    ("Give me an analogy for {c}.", "c"), ("What are some examples of {c} in everyday life?", "c"),
    ("What do I need to know about {c}?", "c"), ("Write a short quiz about {c}.", "c"),
    ("What is the best way to {t}?", "t"), ("Help me {t}.", "t"),
    ("I have never tried to {t}. Can you guide me?", "t"), ("What do I need to {t}?", "t"),
    ("How long does it take to {t}?", "t"), ("Give me five tips to {t}.", "t"),
    ("Write {l} code to {k}.", "kl"), ("How can I {k} in {l}? Show an example.", "kl"),
    ("Explain how to {k} in {l} step by step.", "kl"),
    ("What is the simplest way to {k} in {l}?", "kl"),
    ("Tell me about the history of {n}.", "n"), ("What language is spoken in {n}?", "n"),
    ("Plan a three-day trip to {n}.", "n"), ("What is the climate like in {n}?", "n"),
    ("What are some traditions in {n}?", "n"),
    ("Write a poem about {w}.", "w"), ("Write a four-line poem about {w}.", "w"),
    ("Write a children's story about {w}.", "w"),
    ("Write an opening paragraph for a novel about {w}.", "w"),
    ("Write a song chorus about {w}.", "w"),
    ("What do {a} eat?", "a"), ("How long do {a} live?", "a"), ("Why are {a} interesting?", "a"),
    ("How do {a} raise their young?", "a"), ("What threats do {a} face in the wild?", "a"),
    ("How is {p} different from {q}?", "pq"), ("{p} or {q}: which is better, and when?", "pq"),
    ("Explain the difference between {p} and {q} with an example.", "pq"),
    ("Who was {h}?", "h"), ("What is {h} known for?", "h"), ("Tell me a fun fact about {h}.", "h"),
    ("What can we learn from {h}?", "h"), ("Write a short biography of {h}.", "h"),
]
STYLES = [
    "", " Keep it short.", " Answer in one sentence.", " Use a numbered list.",
    " Use bullet points.", " Explain in detail.", " Give an example.",
    " Answer as if I were five years old.", " Be concise.", " Use simple words.",
]
FOLLOW_UPS = [
    "Can you explain that more simply?", "Can you give me an example?", "Tell me more.",
    "Can you summarize that in one sentence?", "Why is that?", "What else should I know?",
    "Can you make it shorter?", "Can you put that in a list?",
    "Thanks! Can you go into more detail?",
    "Is there anything I should be careful about?", "What would an expert add to that?",
    "Can you rewrite that in a more formal tone?", "What is the most important point?",
    "Can you give me three more ideas?", "How would you explain this to a child?",
]

# Key words of the held-out questions: the pool must never contain them.
HELD_OUT_WORDS = (
    "capital of France", "join two paths", "sky", "drinking water", "book for a long flight",
    "refrigerator", "limerick", "thunder", "lightning", "productive in the morning",
    "neural network", "apologize", "planets", "day off", "Pythagorean", "airplane",
    "pancake", "noun", "leaves change", "center a div", "CSS", "healthy heart", "da Vinci",
    "recursion", "camping", "bicycle", "bakery", "serendipity", "microwave", "tweet",
    "prime numbers", "easier to read", "life cycle of a frog", "tallest mountain",
)


def _subjects() -> dict[str, list]:
    langs = LANGUAGES + MORE_LANGUAGES
    return {
        "c": CONCEPTS + MORE_CONCEPTS, "t": TASKS + MORE_TASKS,
        "kl": [(k, lang) for k in CODE_TASKS + MORE_CODE_TASKS for lang in langs],
        "n": COUNTRIES + MORE_COUNTRIES, "w": WRITING_SUBJECTS + MORE_WRITING_SUBJECTS,
        "a": ANIMALS + MORE_ANIMALS, "pq": PAIRS + MORE_PAIRS, "h": PERSONS,
    }


def _fill(template: str, kind: str, subject) -> str:
    if kind == "kl":
        return template.format(k=subject[0], l=subject[1])
    if kind == "pq":
        text = template.format(p=subject[0], q=subject[1])
        return text[0].upper() + text[1:]
    return template.format(**{kind: subject})


def _messages_by_kind() -> list[list[str]]:
    subjects = _subjects()
    groups = [[_fill(t, kind, s) + style
               for t, k in FIRST_TURN_TEMPLATES if k == kind
               for s in subjects[kind] for style in STYLES]
              for kind in subjects]
    groups.append([t.format(x=x) for t in TEXT_TEMPLATES for x in TEXTS])
    groups.append([t.format(a=a, b=b, c=a * a) for t in MATH_TEMPLATES
                   for a, b in itertools.permutations(NUMBERS, 2)])
    return groups


@functools.lru_cache(maxsize=1)
def message_pool(seed: int = 1234) -> tuple[str, ...]:
    """Every distinct first-turn message (held-out ones excluded) in a fixed seeded order that
    takes the kinds in turn, so any prefix of the pool mixes them evenly (code questions alone
    would otherwise be half of it)."""
    held_out = set(HELD_OUT_PROMPTS)
    rng = random.Random(seed)
    groups = []
    for group in _messages_by_kind():
        group = [m for m in dict.fromkeys(group) if m not in held_out]
        rng.shuffle(group)
        groups.append(group)
    interleaved = (m for row in itertools.zip_longest(*groups) for m in row if m is not None)
    return tuple(dict.fromkeys(interleaved))


def follow_up(index: int) -> str:
    """The second user turn asked after the reply to pool message `index`."""
    return FOLLOW_UPS[index % len(FOLLOW_UPS)]
