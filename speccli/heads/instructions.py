"""Requests for the target to answer, made offline: heads learn best from the text they will
draft in, which is the target's own answers to requests like a user's (code, explanations,
everyday chat, arithmetic, translation), not the stdlib's sources alone.

Made from templates, hand-written topics and the standard library's documented functions,
the same list on every machine (a seeded shuffle). None of them is one of the benchmark's
prompts (scripts/prompts/default.jsonl): heads trained on those would be measured on text
they had seen.
"""

from __future__ import annotations

import random
from typing import Iterator

from speccli.heads.corpus import read_text_file, documented_functions, stdlib_files

TOPICS = (
    "learning a new language",
    "saving money on groceries",
    "staying focused while working from home",
    "keeping houseplants alive",
    "preparing for a job interview",
    "running a first marathon",
    "writing clear documentation",
    "reviewing a pull request",
    "starting to cook at home",
    "reducing screen time",
    "planning a trip on a budget",
    "taking better photos with a phone",
    "keeping a small garden",
    "making a presentation less boring",
    "organising a shared kitchen",
    "choosing a first programming language",
    "backing up personal files",
    "learning to play the guitar",
    "hosting a dinner for friends",
    "keeping a bicycle in good shape",
    "reading more books",
    "onboarding a new colleague",
    "writing unit tests",
    "debugging a slow web page",
    "moving to a new city",
    "training a puppy",
)
PEOPLE = ("my manager", "a colleague", "my neighbour", "a customer", "my team", "a professor", "the IT helpdesk")
EMAIL_REASONS = (
    "asking to move our meeting to next week",
    "thanking them for their help with a project",
    "reporting that the printer on our floor is broken",
    "asking for feedback on a draft report",
    "announcing that I will be on holiday for two weeks",
    "requesting access to a shared folder",
    "apologising for missing yesterday's call",
    "inviting them to a small farewell party",
)
QUESTIONS = (
    "why leaves change colour in autumn",
    "how a refrigerator keeps food cold",
    "why we have seasons",
    "how vaccines help the body",
    "why the moon has phases",
    "how airplanes stay in the air",
    "what a computer's memory does",
    "why ice floats on water",
    "how rainbows form",
    "what causes thunder",
    "how the internet sends a message",
    "why bread rises",
    "how a compass works",
    "what DNA is",
)
CONCEPTS = (
    "recursion",
    "a hash table",
    "Big-O notation",
    "a race condition",
    "garbage collection",
    "a REST API",
    "version control",
    "a closure",
    "dependency injection",
    "a linked list",
    "unit testing versus integration testing",
    "the difference between a process and a thread",
    "caching",
    "an index in a database",
    "immutability",
)
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")
SENTENCES = (
    "The library closes early on Fridays.",
    "Could you send me the report by Thursday?",
    "We are looking for a quiet hotel near the old town.",
    "My brother plays the piano every evening.",
    "The train was late because of the snow.",
    "Please turn off the lights when you leave the office.",
    "I would like to book a table for four people.",
    "The museum is free on the first Sunday of the month.",
    "Our new colleague starts on Monday.",
    "It has been raining all week, so the garden is very green.",
    "Where can I buy a ticket for the bus?",
    "The software update fixed the problem with the printer.",
    "She has lived in this village for twenty years.",
    "We need to leave at seven to catch the flight.",
)
CODE_TASKS = (
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "merges two sorted lists into one sorted list",
    "counts how often each word appears in a sentence",
    "returns the n largest numbers of a list without sorting the whole list",
    "parses a date like 2024-03-15 and returns the weekday's name",
    "flattens a nested list of any depth",
    "removes duplicate lines from a file while keeping their order",
    "converts a Roman numeral to an integer",
    "groups a list of dictionaries by the value of one key",
    "checks whether a number is prime",
    "computes the moving average of a list with a given window",
    "validates a simple email address",
    "reads a CSV file and prints the average of one column",
    "retries a function up to three times on an exception",
    "finds the longest common prefix of a list of strings",
    "converts a temperature between Celsius and Fahrenheit",
)
CODE_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "Bash", "SQL", "Go")
EXHAUSTED_AFTER = 500  # duplicates in a row after which a kind of request is taken to have no new ones


def _chat(rng: random.Random) -> str:
    kind = rng.randrange(5)
    topic = rng.choice(TOPICS)
    if kind == 0:
        return f"Give me {rng.choice(('three', 'four', 'six'))} practical tips for {topic}."
    if kind == 1:
        return f"Write a short email to {rng.choice(PEOPLE)} {rng.choice(EMAIL_REASONS)}."
    if kind == 2:
        return f"Explain to a child {rng.choice(QUESTIONS)}."
    if kind == 3:
        return f"What are the pros and cons of {topic}? Keep it brief."
    return f"Write a short story, four or five sentences, about someone {topic}."


def _arithmetic(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return f"Compute {rng.randint(12, 999)} * {rng.randint(11, 99)} step by step."
    if kind == 1:
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        return f"What is {a} + {b} - {rng.randint(10, 999)}? Show your work."
    if kind == 2:
        start_h, start_m = rng.randint(5, 15), rng.randrange(0, 60, 5)
        minutes = rng.randint(40, 300)
        return f"A bus leaves at {start_h:02d}:{start_m:02d} and the trip takes {minutes} minutes. When does it arrive?"
    if kind == 3:
        return f"What is {rng.choice((5, 12, 15, 20, 25, 40))}% of {rng.randint(20, 2000)}? Explain briefly."
    n = rng.randint(3, 9)
    price = rng.randint(2, 40)
    return f"{n} notebooks cost {n * price} euros. How much do {n + rng.randint(1, 5)} notebooks cost?"


def _translation(rng: random.Random) -> str:
    return f'Translate into {rng.choice(LANGUAGES)}: "{rng.choice(SENTENCES)}"'


def _code(rng: random.Random) -> str:
    kind = rng.randrange(3)
    task = rng.choice(CODE_TASKS)
    if kind == 0:
        return f"Write a {rng.choice(CODE_LANGUAGES)} function that {task}."
    if kind == 1:
        return f"Explain {rng.choice(CONCEPTS)} with a short Python example."
    return f"Write a Python function that {task}, with type hints and a docstring."


def _stdlib_requests() -> Iterator[str]:
    """The stdlib's documented functions, asked for or asked about."""
    for number, path in enumerate(stdlib_files()):
        text = read_text_file(path)
        if not text:
            continue
        for request, answer in documented_functions(text, limit=1):
            if number % 2:
                yield request
            elif len(answer) < 1500:
                yield f"Explain what this Python function does:\n\n{answer}"


def requests(count: int, seed: int = 0) -> list[str]:
    """`count` requests, a mix of every kind, the same list for the same arguments (and a
    longer list begins with a shorter one). A kind whose templates run out of new requests
    gives its turns to the next kind."""
    rng = random.Random(seed)
    makers = (_chat, _arithmetic, _translation, _code)
    stdlib = _stdlib_requests()
    made: list[str] = []
    seen: set[str] = set()
    exhausted: set[int] = set()
    repeats = 0  # duplicates in a row from the kind whose turn it is
    for _ in range(50 * count):  # the templates make far more than are asked for; this only bounds the loop
        if len(made) >= count or len(exhausted) == len(makers) + 1:
            break
        turn = len(made) % 5
        while turn in exhausted:
            turn = (turn + 1) % 5
        text = next(stdlib, None) if turn == 4 else makers[turn](rng)
        if text is None:
            text = _code(rng)
        if text not in seen:
            seen.add(text)
            made.append(text)
            repeats = 0
        else:
            repeats += 1
            if repeats >= EXHAUSTED_AFTER:
                exhausted.add(turn)
                repeats = 0
    return made
