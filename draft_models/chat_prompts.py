"""Chat questions for distilling a draft from a chat target, written here (no data set download).

`training_prompts(n, seed)` combines question templates with subjects of their kind (science,
history, everyday tasks, programming, writing, ...) into `n` distinct user messages.
`HELD_OUT_PROMPTS` are written separately, on subjects and in phrasings the templates never
produce, to measure acceptance on chats the draft never saw.
"""

from __future__ import annotations

import random

CONCEPTS = [
    "photosynthesis", "gravity", "inflation", "democracy", "the water cycle", "black holes",
    "climate change", "machine learning", "the immune system", "plate tectonics",
    "supply and demand", "the French Revolution", "the Renaissance", "evolution",
    "electricity", "the internet", "blockchain", "compound interest", "the stock market",
    "vaccines", "DNA", "the solar system", "volcanoes", "earthquakes", "the moon landing",
    "the Roman Empire", "World War I", "the Industrial Revolution", "renewable energy",
    "nuclear power", "quantum computing", "artificial intelligence", "the human brain",
    "sleep", "nutrition", "meditation", "global warming", "the ozone layer", "recycling",
    "cryptography", "the printing press", "the Silk Road", "ancient Egypt", "the Great Wall",
    "the theory of relativity", "magnetism", "sound waves", "rainbows", "tides", "seasons",
    "the Cold War", "the European Union", "the United Nations", "taxes", "credit scores",
    "mortgages", "the placebo effect", "antibiotics", "viruses", "bacteria", "coral reefs",
    "rainforests", "deserts", "glaciers", "hurricanes", "tornadoes", "the Big Bang",
    "dark matter", "the periodic table", "chemical reactions", "acids and bases",
    "cloud computing", "operating systems", "databases", "encryption", "open source software",
]
TASKS = [
    "learn a new language", "start running", "save money", "write a resume",
    "prepare for a job interview", "improve my sleep", "cook rice", "make bread at home",
    "plant a vegetable garden", "study for an exam", "reduce stress", "organize my desk",
    "start a small business", "learn to play guitar", "train a puppy", "write a cover letter",
    "make new friends", "give a good presentation", "stay focused while working from home",
    "change a flat tire", "plan a trip to Japan", "make a budget", "learn to draw",
    "keep houseplants alive", "read more books", "wake up early", "negotiate a salary",
    "write a short story", "take better photos", "learn to swim", "eat healthier",
    "clean a cast iron pan", "set up a home network", "back up my computer",
]
CODE_TASKS = [
    "reverse a string", "read a file line by line", "sort a list of dictionaries by a key",
    "remove duplicates from a list", "check if a number is prime", "merge two dictionaries",
    "count words in a text", "parse JSON", "make an HTTP request", "write a class",
    "handle exceptions", "use list comprehensions", "find the largest element in a list",
    "compute a factorial", "generate random numbers", "work with dates and times",
    "write to a CSV file", "use a dictionary", "iterate over two lists at once",
    "convert a string to an integer", "define a function with default arguments",
    "flatten a nested list", "check if a string is a palindrome", "compute Fibonacci numbers",
    "use a for loop", "split a string", "join a list of strings", "create a virtual environment",
]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "Rust", "Go", "SQL", "Bash"]
COUNTRIES = [
    "France", "Germany", "Japan", "Brazil", "Canada", "Australia", "India", "Egypt", "Mexico",
    "Italy", "Spain", "Kenya", "Norway", "Argentina", "South Korea", "Turkey", "Vietnam",
    "Peru", "Greece", "Ireland", "Thailand", "Poland", "Chile", "Morocco", "Sweden",
]
WRITING_SUBJECTS = [
    "the ocean", "autumn", "a rainy day", "friendship", "a lost cat", "the city at night",
    "coffee", "a robot learning to love", "the first day of school", "mountains", "the stars",
    "a dragon who is afraid of fire", "a busy market", "winter mornings", "a lighthouse",
    "time travel", "an old library", "a garden in spring", "the moon", "a long journey",
]
ANIMALS = [
    "elephants", "dolphins", "owls", "bees", "octopuses", "penguins", "cats", "dogs", "wolves",
    "sharks", "ants", "butterflies", "horses", "eagles", "frogs", "whales", "bats", "tigers",
]
PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "storage"), ("a list", "a tuple"),
    ("Python", "JavaScript"), ("stocks", "bonds"), ("speed", "velocity"), ("mass", "weight"),
    ("a crocodile", "an alligator"), ("a latte", "a cappuccino"), ("TCP", "UDP"),
    ("an atom", "a molecule"), ("a democracy", "a republic"), ("HTTP", "HTTPS"),
    ("baking soda", "baking powder"), ("a simile", "a metaphor"), ("a comet", "an asteroid"),
]

TEMPLATES = [
    ("Explain {c} in simple terms.", "c"),
    ("What is {c}?", "c"),
    ("Can you explain how {c} works?", "c"),
    ("Why is {c} important?", "c"),
    ("Give me three interesting facts about {c}.", "c"),
    ("Explain {c} to a ten-year-old.", "c"),
    ("What are the main ideas behind {c}?", "c"),
    ("Summarize the history of {c} in a few sentences.", "c"),
    ("How do I {t}?", "t"),
    ("What are some tips to {t}?", "t"),
    ("Give me a step-by-step plan to {t}.", "t"),
    ("I want to {t}. Where should I start?", "t"),
    ("What mistakes should I avoid when I try to {t}?", "t"),
    ("How do I {k} in {l}?", "kl"),
    ("Write a {l} function to {k}.", "kl"),
    ("Show me an example of how to {k} in {l}.", "kl"),
    ("What is the capital of {n}?", "n"),
    ("Tell me about the culture of {n}.", "n"),
    ("What is {n} famous for?", "n"),
    ("What should I visit in {n}?", "n"),
    ("What food is popular in {n}?", "n"),
    ("Write a short poem about {w}.", "w"),
    ("Write a haiku about {w}.", "w"),
    ("Write a short story about {w}.", "w"),
    ("Describe {w} in a few sentences.", "w"),
    ("Tell me some fun facts about {a}.", "a"),
    ("How do {a} communicate?", "a"),
    ("Where do {a} live and what do they eat?", "a"),
    ("What is the difference between {p} and {q}?", "pq"),
    ("Compare {p} and {q}.", "pq"),
]


def _fill(template: str, kind: str, rng: random.Random) -> str:
    if kind == "kl":
        return template.format(k=rng.choice(CODE_TASKS), l=rng.choice(LANGUAGES))
    if kind == "pq":
        p, q = rng.choice(PAIRS)
        return template.format(p=p, q=q)
    pool = {"c": CONCEPTS, "t": TASKS, "n": COUNTRIES, "w": WRITING_SUBJECTS, "a": ANIMALS}[kind]
    return template.format(**{kind: rng.choice(pool)})


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct user messages, templates cycled so every kind of question is represented."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    attempts = 0
    while len(out) < n:
        template, kind = TEMPLATES[attempts % len(TEMPLATES)]
        attempts += 1
        prompt = _fill(template, kind, rng)
        if prompt not in seen and prompt not in HELD_OUT_PROMPTS:
            seen.add(prompt)
            out.append(prompt)
        if attempts > 100 * n:
            raise ValueError(f"cannot make {n} distinct prompts from the templates")
    return out


# Subjects and phrasings that the templates above never produce.
HELD_OUT_PROMPTS = (
    "What is the capital of France?",
    "How do I join two paths in Python?",
    "Why is the sky blue?",
    "What are the benefits of drinking water?",
    "Can you recommend a good book for a long flight?",
    "How does a refrigerator keep food cold?",
    "Write a limerick about a programmer who loves tea.",
    "What causes thunder and lightning?",
    "How can I be more productive in the morning?",
    "Explain what a neural network is.",
    "What's a good way to apologize to a friend?",
    "How many planets are in our solar system?",
    "Write an email asking my manager for a day off.",
    "What is the Pythagorean theorem?",
    "How do airplanes stay in the air?",
    "Give me a recipe for pancakes.",
    "What is the difference between a noun and a verb?",
    "Why do leaves change color in the fall?",
    "How do I center a div in CSS?",
    "What are some good habits for a healthy heart?",
    "Who was Leonardo da Vinci?",
    "Explain recursion with an example.",
    "What should I pack for a camping trip?",
    "How does a bicycle stay balanced?",
    "Suggest a name for a bakery.",
    "What is the meaning of the word 'serendipity'?",
    "How does a microwave oven heat food?",
    "Write a tweet announcing a new coffee shop.",
    "What are prime numbers?",
    "How do I make my code easier to read?",
    "Describe the life cycle of a frog.",
    "What is the tallest mountain in the world?",
)
