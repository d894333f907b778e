"""Writes `quickstart.jsonl`, the small English corpus behind `builtin://quickstart`.

The prose is composed here from hand-written sentence parts and a fixed seed, so the file is
reproducible and owes nothing to any outside text: `python generate_quickstart.py` rewrites it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 1234
RECORDS = 600

PEOPLE = [
    "the old miller",
    "a young shepherd",
    "the ferryman",
    "my grandmother",
    "the schoolteacher",
    "a tired traveller",
    "the lighthouse keeper",
    "the blacksmith's daughter",
    "a quiet monk",
    "the village baker",
    "a sailor home from the sea",
    "the doctor",
    "two small boys",
    "the widow at the end of the lane",
    "a clerk from the city",
]
PLACES = [
    "the harbour",
    "the mill by the river",
    "the top of the hill",
    "the market square",
    "the edge of the forest",
    "the long road north",
    "the orchard",
    "the chapel",
    "the narrow bridge",
    "the salt marsh",
    "the kitchen garden",
    "the station",
]
TIMES = [
    "In the spring",
    "Late in the autumn",
    "Before dawn",
    "On a grey morning",
    "At midsummer",
    "When the snow had gone",
    "Every evening",
    "On market day",
    "After the long rain",
    "In the last week of harvest",
]
ACTIONS = [
    "walked slowly to",
    "carried a basket of apples to",
    "went looking for a lost dog near",
    "sat for an hour at",
    "sang an old song at",
    "waited for the post at",
    "mended a fishing net at",
    "counted the sheep near",
    "read a letter aloud at",
    "planted a row of beans beside",
]
WEATHER = [
    "The wind came off the water and smelled of salt.",
    "A thin rain fell and the roofs shone like glass.",
    "The sky was clear and the light was very gold.",
    "Fog lay over the fields until the sun burned it away.",
    "It was warm, and the bees were busy in the clover.",
    "The frost made every blade of grass stand up white.",
    "Clouds moved fast across the moon all night.",
]
THOUGHTS = [
    "Nobody knew how long the old ways would last.",
    "It is strange how a small kindness is remembered for years.",
    "Work done well is its own reward, the saying goes.",
    "A good neighbour is worth more than a full purse.",
    "Time moves slowly in a village and quickly in a city.",
    "The river does not hurry, yet it always reaches the sea.",
    "Bread tastes best when you have helped to bake it.",
    "Most stories are true, if you wait long enough.",
]
REPLIES = [
    '"We shall see," said {p}, and smiled.',
    '"Come in out of the cold," said {p}.',
    '"I have seen this before," said {p}, "and it ended well."',
    '"Tomorrow will be better," said {p}.',
    '"Mind the step," said {p}, "it is older than I am."',
]
FACTS = [
    "Water boils at one hundred degrees at the level of the sea.",
    "The earth turns once each day and goes around the sun once each year.",
    "Bees carry pollen from flower to flower, and fruit follows.",
    "A week has seven days, and a year has twelve months.",
    "Iron rusts when it is left in wet air for a long time.",
    "The moon has no light of its own; it shines with the light of the sun.",
    "Seeds need water, warmth and air before they will grow.",
    "Sound travels faster through water than through air.",
]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    person = rng.choice(PEOPLE)
    if kind < 0.45:
        return f"{rng.choice(TIMES)}, {person} {rng.choice(ACTIONS)} {rng.choice(PLACES)}."
    if kind < 0.6:
        return rng.choice(WEATHER)
    if kind < 0.72:
        return rng.choice(THOUGHTS)
    if kind < 0.86:
        return rng.choice(REPLIES).format(p=person)
    return rng.choice(FACTS)


def _paragraph(rng: random.Random) -> str:
    text = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
    return text[0].upper() + text[1:]


def main() -> None:
    rng = random.Random(SEED)
    out = Path(__file__).with_name("quickstart.jsonl")
    with out.open("w", encoding="utf-8") as f:
        for _ in range(RECORDS):
            f.write(json.dumps({"text": _paragraph(rng)}) + "\n")


if __name__ == "__main__":
    main()
