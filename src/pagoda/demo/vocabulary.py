"""The demo tasks' vocabulary: the names, places and words their problems are drawn from.

Wide on purpose: the model is meant to copy any short word it is given (a pet called `rex`, a city it never
saw), so beside these lists the copying families also draw made-up words (`made_up_word`), which no list
could cover.
"""

from __future__ import annotations

import random
import string

NAMES = (
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Karl", "Liam",
    "Mia", "Nina", "Omar", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy", "Xavier",
    "Yara", "Zoe", "Anna", "Ben", "Chloe", "Dan", "Eva", "Felix", "Gina", "Hugo", "Iris", "Jack", "Kate",
    "Leo", "Maya", "Noah", "Olga", "Pedro", "Ruth", "Sven", "Tom", "Ada", "Bruno", "Clara", "Diego", "Elena",
    "Finn", "Hana", "Igor", "Jonas", "Kenji", "Lara", "Marco", "Nadia", "Oscar", "Priya", "Raj", "Sofia",
    "Theo", "Vera", "Wei", "Yusuf", "Zara", "Amir", "Bianca", "Carlos", "Dmitri", "Emma", "Fatima", "Hassan",
    "Ines", "Jamal", "Kira", "Lucas", "Mei", "Nora", "Pablo", "Rex", "Sara", "Timo", "Ana", "Max", "Luna",
)
CITIES = (
    "Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Berlin", "Madrid", "Vienna", "Prague",
    "Dublin", "Lisbon", "Athens", "Seoul", "Quito", "Nairobi", "Sydney", "Boston", "Denver", "Toronto",
    "Havana", "Dakar", "Hanoi", "Kyiv", "Riga", "Bern", "Sofia", "Tunis", "Perth", "London", "Milan",
    "Munich", "Zurich", "Warsaw", "Chicago", "Austin", "Miami", "Bogota", "Santiago", "Manila", "Osaka",
    "Mumbai", "Dubai", "Istanbul", "Helsinki", "Porto", "Seville", "Krakow", "Lyon", "Geneva", "Taipei",
)
FOODS = (
    "apples", "bread", "cheese", "rice", "soup", "pasta", "pizza", "salad", "tea", "coffee", "honey",
    "figs", "plums", "grapes", "nuts", "tacos", "noodles", "sushi", "curry", "pears", "cake", "eggs",
    "beans", "olives", "mangoes", "lemons", "dumplings", "pancakes", "cookies", "yogurt",
)
ANIMALS = (
    "cat", "dog", "fish", "bird", "horse", "rabbit", "turtle", "hamster", "parrot", "snake", "frog", "goat",
    "duck", "mouse", "lizard", "pony", "ferret", "owl", "crab", "sheep", "pig", "cow", "chicken", "bee",
)
COLORS = (
    "red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "gray", "gold",
    "silver", "teal", "navy", "beige",
)
PET_NAMES = (
    "rex", "max", "luna", "bella", "buddy", "milo", "coco", "rocky", "daisy", "charlie", "lucy", "toby",
    "bailey", "oreo", "pepper", "simba", "nala", "ziggy", "biscuit", "shadow",
)
NOUNS = (
    "book", "table", "chair", "lamp", "door", "window", "river", "mountain", "tree", "flower", "car", "train",
    "boat", "plane", "phone", "cup", "glass", "key", "box", "bag", "shoe", "hat", "coat", "ring", "clock",
    "pen", "paper", "stone", "cloud", "star", "moon", "sun", "rain", "snow", "wind", "fire", "water", "road",
    "house", "garden", "school", "music", "song", "game", "ball", "kite", "bridge", "tower", "island", "forest",
)
WORDS = tuple(dict.fromkeys(w.lower() for w in (*FOODS, *ANIMALS, *COLORS, *CITIES, *PET_NAMES, *NOUNS)))


def made_up_word(rng: random.Random) -> str:
    """A pronounceable-or-not lowercase word of 2-8 letters: stands for any name the lists lack."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))


def any_word(rng: random.Random) -> str:
    """A word from the lists, or (one time in three) a made-up one."""
    return made_up_word(rng) if rng.random() < 1 / 3 else rng.choice(WORDS)
