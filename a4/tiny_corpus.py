"""The corpus of the trained tiny Qwen3.5: templated English and chats, written by this module, seeded.

`documents(seed, count)` draws `count` documents, each one of:
- a short story ("Once upon a time, there was a little cat named Mia. ..."), with its names, animals, places and
  things drawn from the lists below;
- a few facts from a small fixed world (capitals, animal sounds, colours of fruit, days and numbers);
- arithmetic questions and answers on small numbers ("Question: What is 7 plus 5? Answer: 7 plus 5 is 12.");
- a chat in Qwen's template (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n...<|im_end|>\\n`), one to
  three turns, sometimes after a system message: greetings, the same facts and sums asked as questions, a story on
  request, thanks.

The text is this project's own (its licence is the project's); nothing is downloaded or copied. The templates are few
and the lists short on purpose: a model of a few MB learns them in minutes on a CPU, so that its greedy text is
fluent and its MTP module, which guesses the token after next, is usually right. A seed decides every document, so
the training run (a4/train_tiny.py) sees the same text on every machine; another seed gives held-out documents drawn
from the same distribution.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

NAMES = (
    "Mia", "Leo", "Anna", "Tom", "Lily", "Max", "Emma", "Ben", "Sara", "Sam", "Nora", "Jack", "Lucy", "Finn", "Ella",
    "Oscar", "Ruby", "Hugo", "Zoe", "Theo", "Ivy", "Noah", "Maya", "Eli", "Clara", "Felix", "Alice", "Omar", "Hana",
    "Ravi", "Greta", "Pablo", "Yuki", "Amara", "Lars", "Nina", "Kofi", "Rosa", "Ada", "Milo",
)  # fmt: skip
ANIMALS = {
    "cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa", "pig": "oink", "horse": "neigh",
    "frog": "ribbit", "owl": "hoot", "lion": "roar", "mouse": "squeak", "bee": "buzz", "goat": "baa",
    "bird": "tweet", "snake": "hiss", "wolf": "howl", "fox": "yip", "bear": "growl", "crow": "caw", "monkey": "ooh",
    "elephant": "trumpet", "donkey": "hee-haw", "chicken": "cluck", "turkey": "gobble", "dove": "coo",
}  # fmt: skip
ADJECTIVES = (
    "little", "big", "happy", "brave", "shy", "kind", "curious", "sleepy", "funny", "clever", "tiny", "old", "young",
    "gentle", "hungry", "lazy", "busy", "proud", "quiet", "lucky",
)  # fmt: skip
PLACES = (
    "small house", "big forest", "quiet village", "green garden", "busy town", "warm barn", "tall tree", "sunny farm",
    "cozy cave", "wooden cabin", "stone castle", "sandy beach",
)  # fmt: skip
LANDMARKS = ("river", "hill", "lake", "old bridge", "school", "park", "sea", "mountain", "market", "meadow", "pond")
ACTIVITIES = (
    "run in the grass", "read a book", "sing a song", "play with a ball", "look at the stars", "dig in the sand",
    "jump in the water", "draw pictures", "climb the rocks", "watch the birds",
)  # fmt: skip
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "pink", "orange", "purple", "brown")
THINGS = (
    "ball", "box", "key", "hat", "book", "shell", "stone", "kite", "map", "cup", "bell", "coin", "leaf", "toy",
    "feather", "ring", "drum", "basket", "lamp", "flute", "blanket", "candle", "button", "spoon",
)  # fmt: skip
TOGETHER = ("played", "laughed", "sang", "ran", "talked", "danced")
FEELINGS = ("happy", "glad", "surprised", "excited", "proud")
CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Canada": "Ottawa", "China": "Beijing", "India": "New Delhi",
    "Norway": "Oslo", "Greece": "Athens", "Mexico": "Mexico City", "Brazil": "Brasilia", "Chile": "Santiago",
    "Poland": "Warsaw", "Portugal": "Lisbon", "Sweden": "Stockholm", "Russia": "Moscow", "Ireland": "Dublin",
    "Austria": "Vienna", "Turkey": "Ankara", "Ghana": "Accra", "Cuba": "Havana", "Nepal": "Kathmandu",
    "Finland": "Helsinki", "Argentina": "Buenos Aires", "Australia": "Canberra", "Vietnam": "Hanoi",
}  # fmt: skip
FRUITS = {
    "banana": "yellow", "apple": "red", "lemon": "yellow", "orange": "orange", "lime": "green", "plum": "purple",
    "cherry": "red", "grape": "green", "pear": "green", "blueberry": "blue", "strawberry": "red", "kiwi": "brown",
    "coconut": "brown", "peach": "orange", "mango": "yellow",
}  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
SYSTEM_PROMPT = "You are a helpful assistant."
GREETINGS = {
    "Hello!": "Hello! How can I help you today?",
    "Hi!": "Hi! What would you like to know?",
    "Good morning!": "Good morning! How can I help you?",
    "How are you?": "I am fine, thank you! How can I help you?",
    "Who are you?": "I am a tiny assistant. I know some facts, sums and stories.",
}
THANKS = {
    "Thank you!": "You are welcome!",
    "Thanks!": "You are welcome! Ask me anything else.",
    "Goodbye!": "Goodbye! Have a nice day!",
}
MAX_OPERAND = 12


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def story(rng: random.Random, animal: str | None = None) -> str:
    animal = animal or rng.choice(list(ANIMALS))
    name, friend = rng.sample(NAMES, 2)
    friend_animal = rng.choice(list(ANIMALS))
    adjective = rng.choice(ADJECTIVES)
    colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
    he = rng.choice(("He", "She"))
    sentences = [
        f"Once upon a time, there was {article(adjective)} {adjective} {animal} named {name}.",
        f"{name} lived in a {rng.choice(PLACES)} near the {rng.choice(LANDMARKS)}.",
        f"Every day, {name} liked to {rng.choice(ACTIVITIES)}.",
        f"One day, {name} found {article(colour)} {colour} {thing}.",
        rng.choice((
            f'"What is this?" {he.lower()} asked.',
            f"{he} was very {rng.choice(FEELINGS)}.",
            f'"I will keep this {thing}," {he.lower()} said.',
        )),
        f"{name} showed the {thing} to {article(friend_animal)} {friend_animal} named {friend}.",
        f"They {rng.choice(TOGETHER)} together until the sun went down.",
        rng.choice(("The end.", f"From that day, {name} and {friend} were best friends.", f"{name} was happy.")),
    ]
    return " ".join(sentences)


def capital(country: str) -> tuple[str, str]:
    return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."


def animal_sound(animal: str) -> tuple[str, str]:
    a = article(animal)
    return f"What sound does {a} {animal} make?", f"{a.capitalize()} {animal} says {ANIMALS[animal]}."


def fruit_colour(fruit: str) -> tuple[str, str]:
    a = article(fruit)
    return f"What colour is {a} {fruit}?", f"{a.capitalize()} {fruit} is {FRUITS[fruit]}."


def next_day(day: str) -> tuple[str, str]:
    return f"What day comes after {day}?", f"After {day} comes {DAYS[(DAYS.index(day) + 1) % len(DAYS)]}."


def number_in_words(n: int) -> tuple[str, str]:
    return f"How do you write {n} in words?", f"{n} in words is {NUMBER_WORDS[n]}."


def plus(a: int, b: int) -> tuple[str, str]:
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def minus(a: int, b: int) -> tuple[str, str]:
    return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."


OPERANDS = range(MAX_OPERAND + 1)
# Every (question, answer) of the fixed world, by category: what `fact` and `sum_question` draw from, and what
# a4/tiny_eval.py asks the trained model. Each answer is a whole sentence, as in the fact documents.
QUESTIONS = {
    "capitals": [capital(country) for country in CAPITALS],
    "animal sounds": [animal_sound(animal) for animal in ANIMALS],
    "fruit colours": [fruit_colour(fruit) for fruit in FRUITS],
    "days": [next_day(day) for day in DAYS],
    "numbers": [number_in_words(n) for n in range(len(NUMBER_WORDS))],
    "sums": [plus(a, b) for a in OPERANDS for b in OPERANDS]
    + [minus(a, b) for a in OPERANDS for b in OPERANDS if b <= a],
}
FACT_CATEGORIES = ("capitals", "animal sounds", "fruit colours", "days", "numbers")


def fact(rng: random.Random) -> tuple[str, str]:
    """A (question, answer) pair about the fixed world, its category drawn first (each as likely)."""
    return rng.choice(QUESTIONS[rng.choice(FACT_CATEGORIES)])


def sum_question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    if rng.random() < 0.6:
        return plus(a, b)
    return minus(max(a, b), min(a, b))


def facts_document(rng: random.Random) -> str:
    return " ".join(fact(rng)[1] for _ in range(rng.randint(3, 6)))


def arithmetic_document(rng: random.Random) -> str:
    pairs = (sum_question(rng) for _ in range(rng.randint(2, 5)))
    return "\n".join(f"Question: {q} Answer: {a}" for q, a in pairs)


def turn(rng: random.Random) -> tuple[str, str]:
    """One user request and the assistant's answer."""
    kind = rng.random()
    if kind < 0.4:
        return fact(rng)
    if kind < 0.7:
        return sum_question(rng)
    animal = rng.choice(list(ANIMALS))
    return story_request(rng.choice(STORY_REQUESTS), animal), story(rng, animal)


STORY_REQUESTS = ("Tell me a story about {}.", "Write a short story about {}.")


def story_request(template: str, animal: str) -> str:
    return template.format(f"{article(animal)} {animal}")


def message(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def chat(rng: random.Random, turns: list[tuple[str, str]]) -> str:
    """The turns as a chat in Qwen's template, sometimes after the system prompt."""
    system = message("system", SYSTEM_PROMPT) if rng.random() < 0.3 else ""
    return system + "".join(message("user", q) + message("assistant", a) for q, a in turns)


def chat_document(rng: random.Random) -> str:
    turns = []
    if rng.random() < 0.3:
        turns.append(rng.choice(list(GREETINGS.items())))
    turns.extend(turn(rng) for _ in range(rng.randint(1, 2)))
    if rng.random() < 0.3:
        turns.append(rng.choice(list(THANKS.items())))
    return chat(rng, turns)


def question_deck(rng: random.Random) -> Iterator[tuple[str, str]]:
    """Every question of QUESTIONS once, in a shuffled order, then all again in another, and so on: drawn from at
    random instead, a model of a few MB trained for minutes meets some facts too seldom to learn them."""
    pairs = [pair for pairs in QUESTIONS.values() for pair in pairs]
    while True:
        rng.shuffle(pairs)
        yield from pairs


def quiz_document(rng: random.Random, deck: Iterator[tuple[str, str]]) -> str:
    """A chat of one to three questions, the next ones of the deck."""
    return chat(rng, [next(deck) for _ in range(rng.randint(1, 3))])


# The share of each kind of document. Chats carry a third of the tokens; quizzes, short, go through the whole deck
# of questions about every 60 training steps (a4/train_tiny.py).
KINDS = {"story": 0.15, "facts": 0.1, "arithmetic": 0.1, "chat": 0.35, "quiz": 0.3}


def documents(seed: int, count: int) -> list[str]:
    """`count` documents drawn with this seed (the same on every machine and Python version)."""
    rng = random.Random(seed)
    deck = question_deck(rng)
    writers = {
        "story": story, "facts": facts_document, "arithmetic": arithmetic_document, "chat": chat_document,
        "quiz": lambda rng: quiz_document(rng, deck),
    }  # fmt: skip
    kinds, weights = zip(*KINDS.items())
    return [writers[rng.choices(kinds, weights)[0]](rng) for _ in range(count)]


ASSISTANT_TURN = f"{IM_START}assistant\n"


def prompt_of(document: str) -> str:
    """The start of a document, for a model to continue: a chat up to where its first answer begins, any other
    document up to the end of its first sentence or line."""
    if ASSISTANT_TURN in document:
        return document[: document.index(ASSISTANT_TURN) + len(ASSISTANT_TURN)]
    ends = [i for i in (document.find(". "), document.find("\n")) if i >= 0]
    return document[: min(ends) + 1] if ends else document
