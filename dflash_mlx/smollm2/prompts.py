"""Training prompts for the SmolLM2-135M-Instruct draft, built offline.

With no internet and no datasets, the prompts are made here: templates filled
from small vocabularies and numbers drawn from a seeded RNG, in the mix a small
chat model sees. The target answers them and the draft learns its answers.

    category   share  what
    math       25%    word problems (shopping, rates, ages, areas, time ...)
    code       25%    functions to write, how-tos, snippets to read
    explain    20%    concepts from science, history, computing, economics, health
    everyday   20%    recipes, advice, emails, lists, travel, poems and stories
    chat       10%    user, a short assistant reply written here, user follow-up

Most requests get an optional lead-in ("I'm a beginner.") and closing request
("Keep it short."), so they run from one to about four sentences. The held-out
set (``heldout.jsonl`` next to this file) is written by hand, apart from these
templates, and is never trained on.

    python -m dflash_mlx.smollm2.prompts --n 2000 --seed 0 --out prompts.jsonl
"""

import argparse
import json
import random
from typing import Callable, Dict, List, Sequence, Tuple

MIX = {"math": 0.25, "code": 0.25, "explain": 0.20, "everyday": 0.20, "chat": 0.10}


def _words(s: str) -> List[str]:
    return [w.strip() for w in s.split(";") if w.strip()]


def _wrap(r: random.Random, s: str, pre: Sequence[str] = (), post: Sequence[str] = (), **kw) -> str:
    """``s`` with an optional lead-in and closing request (only those are formatted)."""
    parts = [r.choice(x).format(**kw) if x and r.random() < 0.6 else "" for x in (pre, post)]
    return " ".join(p for p in (parts[0], s, parts[1]) if p)


NAMES = _words("Ava;Ben;Chloe;Daniel;Elena;Farid;Grace;Hiro;Isla;Jonas;Kemi;Liam;Maya;Noah;Olga;Priya;"
               "Quinn;Rosa;Sam;Tariq;Uma;Victor;Wen;Yusuf;Zoe;Marco;Aisha;Leo;Nina;Omar")
THINGS = _words("pencil;notebook;apple;cupcake;sticker;marble;ticket;candle;mug;plant;comic book;toy car;"
                "orange;cookie;postcard;bracelet;eraser;balloon")
GOODS = _words("jacket;backpack;lamp;bicycle;watch;blender;tent;guitar;chair;printer;desk;rug")
CITIES = _words("Lisbon;Tokyo;Mexico City;Rome;Cape Town;Vancouver;Istanbul;Seoul;Prague;Buenos Aires;"
                "Edinburgh;Hanoi;Marrakech;Sydney;Copenhagen;Lima")
MONTHS = _words("January;March;April;May;June;July;September;October;November;December")
RELS = _words("mom;dad;sister;brother;best friend;grandmother;grandfather;aunt;coworker;son;daughter")
JOBS = _words("teacher;lawyer;chef;carpenter;graphic designer;bus driver;musician;retired pilot;student")
LANGS = ["Python"] * 6 + _words("JavaScript;Java;C++;Rust;Go;TypeScript;C#")

# Math: each maker returns (question, worked answer); chats reuse the answer.


def _shop(r: random.Random) -> Tuple[str, str]:
    who, it, n, p = r.choice(NAMES), r.choice(THINGS), r.randint(2, 9), r.randint(2, 15)
    bill, cost = 10 * (n * p // 10 + r.randint(1, 3)), n * p
    q = f"{who} buys {n} {it}s for ${p} each and pays with a ${bill} bill. How much change does {who} get?"
    return q, f"The {it}s cost {n} x ${p} = ${cost}, so the change is ${bill} - ${cost} = ${bill - cost}."


def _share(r: random.Random) -> Tuple[str, str]:
    who, it, k, each = r.choice(NAMES), r.choice(THINGS), r.randint(2, 8), r.randint(3, 12)
    left = r.choice([0, 0, r.randint(1, k - 1)])
    tot = k * each + left
    q = f"{who} has {tot} {it}s and shares them equally among {k} friends. How many does each friend get"
    q += ", and how many are left over?" if left else "?"
    a = f"{tot} / {k} = {each}" + (f" with {left} left over" if left else "")
    return q, f"{a}, so each friend gets {each} {it}s."


def _speed(r: random.Random) -> Tuple[str, str]:
    v, t = r.choice([40, 45, 50, 60, 72, 80, 90, 120]), r.randint(2, 7)
    if r.random() < 0.5:
        veh = r.choice(["train", "car", "bus", "truck"])
        q = f"A {veh} travels at {v} km/h for {t} hours. How far does it go?"
        return q, f"Distance = speed x time = {v} x {t} = {v * t} km."
    q = f"{r.choice(NAMES)} drives {v * t} km in {t} hours. What is the average speed?"
    return q, f"Average speed = distance / time = {v * t} / {t} = {v} km/h."


def _discount(r: random.Random) -> Tuple[str, str]:
    it, pct, p = r.choice(GOODS), r.choice([10, 15, 20, 25, 30, 40, 50]), 20 * r.randint(2, 20)
    off = p * pct // 100
    q = f"A {it} normally costs ${p}. This week it is {pct}% off. What is the sale price?"
    return q, f"{pct}% of ${p} is ${off}, so the sale price is ${p} - ${off} = ${p - off}."


def _reading(r: random.Random) -> Tuple[str, str]:
    who, per, days = r.choice(NAMES), r.randint(8, 40), r.randint(5, 30)
    q = f"{who} reads {per} pages every day. How many days will it take to finish a {per * days}-page book?"
    return q, f"{per * days} / {per} = {days}, so it takes {days} days."


def _ages(r: random.Random) -> Tuple[str, str]:
    (a, b), age, k, y = r.sample(NAMES, 2), r.randint(4, 15), r.randint(2, 4), r.randint(2, 10)
    q = f"{a} is {age} years old and {b} is {k} times as old. How old will {b} be in {y} years?"
    return q, f"{b} is {k} x {age} = {k * age} now, so in {y} years {b} will be {k * age + y}."


def _fence(r: random.Random) -> Tuple[str, str]:
    w, l, c = r.randint(3, 20), r.randint(4, 30), r.randint(3, 12)
    place, per = r.choice(["garden", "yard", "field", "playground", "dog run"]), 2 * (w + l)
    q = (f"A rectangular {place} is {w} m wide and {l} m long. Fencing costs ${c} per metre. "
         f"How much does it cost to fence the whole {place}?")
    return q, f"The perimeter is 2 x ({w} + {l}) = {per} m, so the fence costs {per} x ${c} = ${per * c}."


def _savings(r: random.Random) -> Tuple[str, str]:
    who, it, s, w = r.choice(NAMES), r.choice(GOODS), r.choice([5, 10, 12, 15, 20, 25]), r.randint(3, 20)
    price = s * w - r.randint(0, s - 1)
    q = f"{who} saves ${s} a week to buy a {it} that costs ${price}. How many weeks until {who} can buy it?"
    return q, f"${price} / ${s} rounds up to {w}, so it takes {w} weeks."


def _recipe(r: random.Random) -> Tuple[str, str]:
    k, m = r.choice([2, 4, 6, 8]), r.choice([3, 5, 10, 12, 16])
    g, ing = r.randint(2, 9) * k * 10, r.choice(["flour", "sugar", "rice", "butter", "oats"])
    q = f"A recipe for {k} people uses {g} grams of {ing}. How much {ing} is needed for {m} people?"
    return q, f"That is {g // k} g per person, so {m} people need {g // k} x {m} = {g // k * m} g."


def _clock(r: random.Random) -> Tuple[str, str]:
    h, mi, d = r.randint(1, 8), 5 * r.randint(0, 11), 5 * r.randint(16, 36)
    end, ev = h * 60 + mi + d, r.choice(["movie", "concert", "football match", "play", "lecture"])
    q = f"A {ev} starts at {h}:{mi:02d} pm and lasts {d} minutes. What time does it end?"
    return q, f"{d} minutes is {d // 60} h {d % 60} min, so it ends at {end // 60}:{end % 60:02d} pm."


def _average(r: random.Random) -> Tuple[str, str]:
    k = r.randint(3, 5)
    xs = [r.randint(55, 100) for _ in range(k - 1)]
    mean = r.randint(max(xs) - 20, 95)
    xs.append(mean * k - sum(xs))
    if not 0 <= xs[-1] <= 100:
        xs[-1], mean = xs[0], (sum(xs[:-1]) + xs[0]) / k
    q = (f"{r.choice(NAMES)} scored {', '.join(map(str, xs))} on {k} "
         f"{r.choice(['tests', 'quizzes', 'games'])}. What is the average score?")
    return q, f"The sum is {sum(xs)} and {sum(xs)} / {k} = {mean:.4g}."


def _sales(r: random.Random) -> Tuple[str, str]:
    a, b, p = r.randint(12, 90), r.randint(12, 90), r.randint(2, 6)
    it = r.choice(["muffins", "loaves of bread", "cups of coffee", "sandwiches", "pies"])
    shop = r.choice(["bakery", "cafe", "food truck", "school fair stand"])
    q = (f"A {shop} sells {a} {it} in the morning and {b} in the afternoon at ${p} each. "
         "How much money does it make that day?")
    return q, f"It sells {a} + {b} = {a + b} {it}, which makes {a + b} x ${p} = ${(a + b) * p}."


MATH = [_shop, _share, _speed, _discount, _reading, _ages, _fence, _savings, _recipe, _clock, _average, _sales]
MATH_PRE = _words("Solve this:;Can you help me with this word problem?;Quick math question.;"
                  "My kid got this homework question:")
MATH_POST = _words("Show your work.;Explain step by step.;Please give the final answer at the end.;"
                   "Walk me through it.")


def math(r: random.Random) -> str:
    return _wrap(r, r.choice(MATH)(r)[0], MATH_PRE, MATH_POST)


TASKS = _words(
    "reverses a string;checks whether a number is prime;counts the vowels in a string;"
    "returns the n-th Fibonacci number;merges two sorted lists into one sorted list;"
    "removes duplicates from a list while keeping the order;converts Celsius to Fahrenheit;"
    "checks whether a string is a palindrome;flattens a nested list;computes the factorial of n;"
    "counts how often each word appears in a text;validates an email address;"
    "sorts a list of dictionaries by a given key;finds the second largest number in a list;"
    "returns all prime numbers below n;computes the greatest common divisor of two numbers;"
    "transposes a matrix;checks whether two strings are anagrams;implements binary search;"
    "capitalizes the first letter of every word;groups words by their first letter;"
    "rotates a list by k positions;finds the longest word in a sentence;sums the digits of an integer;"
    "converts a Roman numeral to an integer;splits a list into chunks of size n;"
    "finds the most common element in a list;converts a number to binary;"
    "checks whether brackets in a string are balanced;returns the intersection of two lists")
HOWTO = _words(
    "read a file line by line;make an HTTP GET request;sort a dictionary by value;handle exceptions;"
    "parse JSON;get the current date and time;generate a random number;join a list of strings;"
    "read command-line arguments;write data to a CSV file;measure how long a function takes;"
    "check if a file exists;remove whitespace from a string;iterate over a dictionary;"
    "define a class with a constructor;run two tasks concurrently;format a number with two decimals")
PAIRS = _words(
    "a list and a tuple;== and is;append and extend;a shallow copy and a deep copy;"
    "a generator and a list comprehension;*args and **kwargs;a class method and a static method;"
    "a set and a dictionary;break and continue;a module and a package;sort() and sorted()")
WRITE_T = [
    "Write a {lang} function that {task}.", "How would I write a function in {lang} that {task}?",
    "Can you show me {lang} code that {task}? Please add comments.",
    "I need a {lang} script that {task}. Keep it short and include an example.",
    "Write a Python function that {task}, then write {k} unit tests for it.",
    "I'm learning {lang}. Could you write a function that {task} and explain how it works?",
    "Write an efficient {lang} function that {task} and tell me its time complexity."]
HOWTO_T = ["How do I {h} in {lang}?", "What is the best way to {h} in {lang}?",
           "Show me how to {h} in {lang}, with a short example.", "In {lang}, how can I {h}?"]
PAIR_T = ["In Python, what is the difference between {p}?", "When should I use {p} in Python?",
          "Can you explain {p} in Python with an example of each?"]
CODE_PRE = _words("I'm a beginner.;I'm working on a {proj}.;Coding interview practice:;Hey, quick one.;"
                  "I'm stuck on something.")
CODE_POST = _words("Please keep it simple.;Don't use any external libraries.;Add a docstring.;"
                   "Explain the approach before the code.;Handle edge cases too.")
PROJECTS = _words("small web app;school assignment;data analysis script;command-line tool;small game;"
                  "home automation script;personal budget tracker")


def _snippet(r: random.Random) -> str:
    xs = [r.randint(1, 20) for _ in range(r.randint(3, 6))]
    a, b, k = r.randint(0, 5), r.randint(6, 15), r.randint(2, 5)
    code = r.choice([
        f"nums = {xs}\nprint(sum(x for x in nums if x % 2 == 0))",
        f"total = 0\nfor i in range({a}, {b}):\n    total += i\nprint(total)",
        f"words = ['{r.choice(NAMES)}', '{r.choice(CITIES)}', '{r.choice(THINGS)}']\n"
        "print(sorted(words, key=len)[-1])",
        f"nums = {xs}\nprint([x * {k} for x in nums if x > {a + 5}])",
        f"s = '{r.choice(NAMES).lower()}{r.choice(THINGS).replace(' ', '')}'\nprint(s[::-1][:{k}])",
        f"d = {{}}\nfor c in '{r.choice(CITIES).lower()}':\n    d[c] = d.get(c, 0) + 1\nprint(max(d, key=d.get))",
    ])
    ask = r.choice(["What does this Python code print?", "Can you explain what this code does line by line?",
                    "What is the output of this snippet, and why?", "How could I make this code more readable?"])
    return f"{ask}\n\n```python\n{code}\n```"


def code(r: random.Random) -> str:
    u, proj = r.random(), r.choice(PROJECTS)
    if u < 0.55:
        s = r.choice(WRITE_T).format(lang=r.choice(LANGS), task=r.choice(TASKS), k=r.randint(2, 5))
    elif u < 0.75:
        s = r.choice(HOWTO_T).format(h=r.choice(HOWTO), lang=r.choice(LANGS))
    else:
        s = _snippet(r) if u < 0.9 else r.choice(PAIR_T).format(p=r.choice(PAIRS))
        return _wrap(r, s, CODE_PRE, proj=proj)
    return _wrap(r, s, CODE_PRE, CODE_POST, proj=proj)


FIELDS: Dict[str, List[str]] = {
    "science": _words(
        "photosynthesis;gravity;black holes;plate tectonics;the water cycle;evolution by natural selection;"
        "DNA;atoms and molecules;climate change;the greenhouse effect;entropy;electricity;magnetism;"
        "the theory of relativity;chemical reactions;ecosystems;the periodic table;sound waves;"
        "volcanoes;the tides;rainbows;the Big Bang"),
    "history": _words(
        "the French Revolution;the Industrial Revolution;the fall of the Roman Empire;the Cold War;"
        "the invention of the printing press;the Silk Road;the Renaissance;the Magna Carta;the space race;"
        "the American civil rights movement;the first moon landing;ancient Egypt;the Black Death;"
        "the Ottoman Empire;the invention of the telephone"),
    "computing": _words(
        "recursion;public-key encryption;DNS;garbage collection;neural networks;operating systems;databases;"
        "the internet;version control;compilers;cloud computing;hash tables;machine learning;"
        "cookies in web browsers;APIs;binary numbers;Wi-Fi;password hashing"),
    "economics": _words(
        "inflation;supply and demand;interest rates;the stock market;opportunity cost;taxes;"
        "compound interest;GDP;recessions;exchange rates;budgeting;credit scores;index funds;mortgages"),
    "health": _words(
        "the immune system;vaccines;blood pressure;sleep cycles;metabolism;cholesterol;hydration;stress;"
        "vitamins;the heart;muscle growth;antibiotics;allergies;the gut microbiome"),
}
SINGULAR = {"DNS", "stress", "photosynthesis", "plate tectonics", "the tides"}  # not plurals
CONTRAST = _words(
    "weather|climate;a virus|bacteria;speed|velocity;RAM|storage;a debit card|a credit card;"
    "mitosis|meiosis;stocks|bonds;HTTP|HTTPS;a comet|an asteroid;saturated fats|unsaturated fats;"
    "AC|DC current;a compiler|an interpreter;renting|buying a home;a republic|a democracy")
AUDIENCES = _words("ten-year-old;high school student;complete beginner;busy manager;grandparent;"
                   "first-year university student")
EXPLAIN_T = ["Explain {c} in simple terms.", "What {is} {c}?", "What {is} {c} and why {does} {it} matter?",
             "Can you explain {c} to a {aud}?", "Give me a short explanation of {c} with one everyday example.",
             "Why {is} {c} important in {field}?", "I keep hearing about {c}. What {is} {it}, in plain English?"]
HOW_T = ["How {does} {c} work?", "I never really understood {c}. Can you walk me through how {it} work{s}?"]
HIST_T = ["What caused {c}?", "Why was {c} important?", "Give me a short overview of {c}.",
          "What were the main consequences of {c}?"]
SHAPED_T = ["Summarize the main idea of {c} in {k} bullet points.", "Describe {c} in exactly {k} sentences.",
            "What are {k} common misconceptions about {c}?"]
CONTRAST_T = ["What is the difference between {a} and {b}?", "How is {a} different from {b}?",
              "Can you compare {a} and {b}?", "People often confuse {a} and {b}. How do I tell them apart?"]
EXPLAIN_PRE = _words("Hi!;Quick question.;For a school project:;My {rel} asked me about this and I had no idea.;"
                     "I'm studying for a {field} exam.;I'm a {job} and know nothing about {field}.")
EXPLAIN_POST = _words("Use an analogy.;Keep it short.;Please avoid jargon.;Give one real-world example.;"
                      "Answer in {k} sentences.;Then ask me a question to check that I understood.")


def explain(r: random.Random) -> str:
    field = r.choice(list(FIELDS))
    kw = dict(field=field, rel=r.choice(RELS), job=r.choice(JOBS), k=r.randint(3, 5))
    if r.random() < 0.12:
        a, b = r.choice(CONTRAST).split("|")
        return _wrap(r, r.choice(CONTRAST_T).format(a=a, b=b), EXPLAIN_PRE[:4], EXPLAIN_POST, **kw)
    c = r.choice(FIELDS[field])
    many = c.endswith("s") and c not in SINGULAR
    v = dict(zip(["is", "does", "it", "s"], ["are", "do", "they", ""] if many else ["is", "does", "it", "s"]))
    if r.random() < 0.15:
        return _wrap(r, r.choice(SHAPED_T).format(c=c, **kw), EXPLAIN_PRE, **kw)
    t = r.choice(EXPLAIN_T + (HIST_T if field == "history" else HOW_T))
    return _wrap(r, t.format(c=c, aud=r.choice(AUDIENCES), **kw, **v), EXPLAIN_PRE, EXPLAIN_POST, **kw)


DISHES = _words("lentil soup;banana bread;chicken curry;vegetable stir-fry;pancakes;tomato pasta;guacamole;"
                "fried rice;shakshuka;a simple salad dressing;chocolate chip cookies;an omelette;"
                "mushroom risotto;fish tacos;hummus;apple pie")
INGREDIENTS = _words("eggs;rice;spinach;chickpeas;potatoes;cheese;tomatoes;onions;pasta;tofu;carrots;"
                     "mushrooms;black beans;bell peppers;yogurt;bread;zucchini;lentils")
GOALS = _words("sleep better;stay focused while working from home;save money on groceries;start running;"
               "drink more water;read more books;keep my apartment tidy;get better at public speaking;"
               "learn a new language;stop procrastinating;make friends in a new city;prepare for a job interview;"
               "reduce screen time;wake up earlier;cook at home more often;feel less anxious before meetings")
EMAILS = _words("my boss asking for a day off on Friday;my landlord about a leaking sink;"
                "a coworker thanking them for their help;my teacher asking for an extension;"
                "a client to reschedule our meeting;my neighbor about a noisy party;"
                "a hotel asking about late check-in;my team announcing a new project;"
                "a company asking for a refund;a recruiter following up after an interview")
LISTS = _words("ideas for a rainy day at home;healthy snacks;gift ideas for a {age}-year-old;"
               "ways to reuse glass jars;questions to ask in a job interview;fun team-building activities;"
               "things to pack for a camping trip;hobbies I can do at home;names for a book club;"
               "board games for a family night;easy houseplants for beginners;ways to save energy at home")
SUBJECTS = _words("the ocean;autumn leaves;a cup of coffee;the city at night;friendship;a lost cat;"
                  "the first day of school;rain on the window;a mountain;my grandmother's kitchen;"
                  "a robot learning to paint;the moon;a lighthouse keeper;a dragon who is afraid of the dark")
PETS = _words("puppy;kitten;goldfish;rabbit;parrot;hamster;turtle")
HOBBIES = _words("gardening;photography;hiking;baking;video games;painting;jazz;chess;yoga;cycling")
OCCASIONS = _words("birthday;thank-you;get-well-soon;congratulations;farewell;happy new year")
EVERYDAY = {  # kind: (templates, lead-ins, closing requests)
    "recipe": (["Give me a recipe for {dish}.", "How do I make {dish}?",
                "What's an easy way to make {dish} for {k} people?",
                "I want to make {dish} tonight. What do I need?"],
               "Hi!;I'm hosting friends this weekend.;I'm a beginner cook.",
               "I only have {mins} minutes.;Please list the ingredients first.;Keep it simple."),
    "fridge": (["What can I cook with {i1}, {i2} and {i3}?", "Suggest a meal using {i1} and {i2}.",
                "I have {i1}, {i2} and {i3} at home. Any dinner ideas?"],
               "I'm tired and hungry.;I don't want to go shopping today.",
               "Nothing too complicated.;I'm vegetarian.;It should take less than {mins} minutes."),
    "advice": (["How can I {goal}?", "Any tips to help me {goal}?", "I want to {goal}. Where should I start?",
                "What are some realistic ways to {goal}?"],
               "I'm a {job}.;I'm {age} years old.;Lately I've been feeling stuck.;"
               "My {rel} thinks I should change my habits.",
               "Give me {k} practical tips.;Keep the answer short.;I've tried before and given up.;"
               "Please be specific."),
    "email": (["Write a short email to {email}.", "Help me write a polite email to {email}.",
               "Draft an email to {email}. Sign it {who}."],
              "I'm not good at writing.;I'm in a hurry.",
              "Keep it friendly but professional.;Keep it under {k} sentences.;Make it sound confident."),
    "list": (["List {k} {lst}.", "Give me {k} {lst}.", "Can you suggest {k} {lst}?"],
             "I need some inspiration.;Help me out here.",
             "Explain each in one line.;Keep them cheap.;Put them in a numbered list."),
    "travel": (["I'm visiting {city} for {n} days in {month}. What should I see?",
                "What should I pack for a {n}-day trip to {city} in {month}?",
                "Plan a {n}-day itinerary for {city}.", "Is {month} a good time to visit {city}?"],
               "My {rel} and I are planning a trip.;I've never been abroad before.;I'm on a tight budget.",
               "I love food and museums.;We're travelling with kids.;I don't like crowds."),
    "write": (["Write a short poem about {subj}.", "Write a haiku about {subj}.",
               "Write a {k}-sentence story about {subj}.", "Write a funny limerick about {subj}.",
               "Write a bedtime story about {subj}."],
              "For a creative writing class:;Something fun for my {rel}:",
              "Make it cheerful.;Make it a little sad.;Use simple words.;Give it a title."),
    "pet": (["Suggest {k} names for my new {pet}.", "I just got a {pet}. What should I name it?",
             "How do I take care of a {pet}?", "What does a {pet} need to stay healthy?"],
            "Exciting news!;I'm a first-time pet owner.",
            "I live in a small apartment.;Keep it short."),
    "gift": (["What's a good gift for my {rel} who likes {hobby}?",
              "Help me choose a birthday present for my {rel}, who loves {hobby}."],
             "I always struggle with gifts.;I need help with a present.",
             "My budget is ${budget}.;Something they can use every day.;Give me {k} ideas.;"
             "Their birthday is next week."),
    "message": (["Write a {occ} message for my {rel}.", "Help me write a short {occ} note to my {rel}."],
                "I'm bad with words.;I want to send it today.",
                "Make it warm and personal.;Keep it to {k} sentences.;Add a little humour."),
}


def everyday(r: random.Random) -> str:
    i1, i2, i3 = r.sample(INGREDIENTS, 3)
    kw = dict(
        k=r.randint(3, 10), n=r.randint(2, 7), mins=r.choice([15, 20, 30, 45]), age=r.randint(16, 70),
        i1=i1, i2=i2, i3=i3, dish=r.choice(DISHES), goal=r.choice(GOALS), email=r.choice(EMAILS),
        who=r.choice(NAMES), lst=r.choice(LISTS).format(age=r.randint(5, 14)), city=r.choice(CITIES),
        month=r.choice(MONTHS), subj=r.choice(SUBJECTS), pet=r.choice(PETS), rel=r.choice(RELS),
        job=r.choice(JOBS), hobby=r.choice(HOBBIES), occ=r.choice(OCCASIONS), budget=r.choice([20, 30, 50, 100]),
    )
    ts, pre, post = EVERYDAY[r.choice(list(EVERYDAY))]
    return _wrap(r, r.choice(ts).format(**kw), _words(pre), _words(post), **kw)


# Chats: a first turn, a short reply written here, a follow-up.
DEFS = {
    "recursion": "a technique where a function solves a problem by calling itself on smaller pieces of it.",
    "inflation": "the general rise in prices over time, so each unit of money buys a bit less.",
    "photosynthesis": "the process plants use to turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "a black hole": "a region of space where gravity is so strong that not even light can escape.",
    "compound interest": "interest earned both on your original money and on the interest it has already earned.",
    "DNS": "the system that translates names like example.com into the numeric addresses computers use.",
    "the immune system": "the network of cells and organs that defends your body against germs.",
    "opportunity cost": "the value of the best option you give up when you make a choice.",
    "a hash table": "a data structure that stores key-value pairs and finds a key quickly with a hash function.",
    "plate tectonics": "the theory that Earth's outer shell is split into plates that slowly move.",
}
FOLLOW = _words("Can you give me an example?;Can you explain that more simply?;Why does that matter?;"
                "How would I explain this to a child?;Can you say more about that?;"
                "Thanks! Can you summarize it in one sentence?")
SOLUTIONS = {
    "reverses a string": "def reverse(s):\n    return s[::-1]",
    "computes the factorial of n":
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
    "finds the largest number in a list":
        "def largest(nums):\n    best = nums[0]\n    for x in nums[1:]:\n        if x > best:\n"
        "            best = x\n    return best",
    "counts the vowels in a string": "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')",
    "checks whether a number is even": "def is_even(n):\n    return n % 2 == 0",
    "converts Celsius to Fahrenheit": "def to_fahrenheit(c):\n    return c * 9 / 5 + 32",
}


def chat(r: random.Random) -> List[Dict[str, str]]:
    u = r.random()
    if u < 0.3:
        c = r.choice(list(DEFS))
        q = r.choice(["What is {}?", "Can you tell me what {} is?", "Quick question: what's {}?"]).format(c)
        a, f = f"{c[0].upper() + c[1:]} is {DEFS[c]}", r.choice(FOLLOW)
    elif u < 0.55:
        q, a = r.choice(MATH)(r)
        f = r.choice(["Can you check that another way?", "Can you explain that step by step?",
                      "Can you give me a similar problem to practice?", "How would I write that as an equation?",
                      f"What if all the numbers were {r.choice(['doubled', 'halved', 'ten times bigger'])}?"])
    elif u < 0.8:
        task = r.choice(list(SOLUTIONS))
        q = f"Write a Python function that {task}."
        a = f"Here is a simple version:\n\n```python\n{SOLUTIONS[task]}\n```"
        f = r.choice(["Can you add type hints and a docstring?", "How would I test it?",
                      "Can you rewrite it in JavaScript?", "What is its time complexity?",
                      "Can you explain how it works line by line?", "How should it handle bad input?"])
    else:
        who, subj = r.choice(NAMES), r.choice(list(FIELDS) + ["math", "French", "biology"])
        when = r.choice(["tomorrow", "on Monday", "next week"])
        q = f"Hi, I'm {who}. I have a {subj} exam {when} and I'm nervous."
        a = (f"Hi {who}! Feeling nervous before an exam is normal. Reviewing the main topics and "
             "getting a good night's sleep will help more than cramming.")
        f = r.choice(["Can you make me a study plan?", "What should I do the morning of the exam?",
                      f"Can you quiz me on {r.choice(FIELDS.get(subj, ['the basics']))}?",
                      "How do I stop my mind from going blank?"])
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}, {"role": "user", "content": f}]


MAKERS: Dict[str, Callable[[random.Random], str]] = {
    "math": math, "code": code, "explain": explain, "everyday": everyday}


def _quotas(n: int) -> List[str]:
    """``n`` categories in the ``MIX`` proportions (largest remainders round up)."""
    raw = {c: n * w for c, w in MIX.items()}
    q = {c: int(v) for c, v in raw.items()}
    for c in sorted(raw, key=lambda c: q[c] - raw[c])[: n - sum(q.values())]:
        q[c] += 1
    return [c for c in MIX for _ in range(q[c])]


def training_prompts(n: int, seed: int = 0) -> List[dict]:
    """``n`` distinct chat records ``{"messages": [...], "category": ...}``.

    Categories follow ``MIX`` exactly (up to rounding), in a shuffled order;
    the same ``seed`` gives the same records.
    """
    r = random.Random(seed)
    cats = _quotas(n)
    r.shuffle(cats)
    seen, out = set(), []
    for cat in cats:
        for _ in range(1000):
            msgs = chat(r) if cat == "chat" else [{"role": "user", "content": MAKERS[cat](r)}]
            key = tuple(m["content"] for m in msgs)
            if key not in seen:
                break
        else:
            raise ValueError(f"could not make {n} distinct prompts (category {cat})")
        seen.add(key)
        out.append({"messages": msgs, "category": cat})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write offline training prompts as JSONL.")
    p.add_argument("--n", type=int, default=2000, help="Number of prompts.")
    p.add_argument("--seed", type=int, default=0, help="Random seed.")
    p.add_argument("--out", required=True, help="Output .jsonl file.")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        for rec in training_prompts(args.n, args.seed):
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
