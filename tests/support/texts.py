"""Fixed texts for checks of a real model: a text to measure perplexity on, chat prompts to compare greedy outputs
over, and prompts whose answer repeats them or does not (speculative decoding). Used by
tests/workers/test_smollm2_fast_paths.py, bench/quantization.py and bench/speculation.py."""

# Written for these checks (no corpus is reachable here): plain expository English of the kind the model saw.
FIXED_TEXT = (
    "Rivers shape the land they cross. Over thousands of years a river carries sand and stones from the mountains "
    "to the sea, cutting valleys where the rock is soft and leaving waterfalls where it is hard. Near its mouth the "
    "water slows, drops what it carries, and builds a delta of rich soil, which is why so many of the first cities "
    "grew up beside great rivers. Farmers used the yearly floods to water their fields, and boats carried grain, "
    "timber and cloth between towns long before there were roads. Today rivers still supply drinking water to "
    "billions of people, turn the turbines of power stations, and carry ships far inland. They also need care: "
    "dams change the flow of water and sediment, factories and farms can pour chemicals into them, and a warmer "
    "climate alters the snow and rain that feed them. Scientists measure the health of a river by the fish and "
    "insects that live in it, the clarity of its water, and the amount of oxygen it holds. Where people have "
    "cleaned up their rivers, salmon and otters have often returned within a few decades, a sign that nature can "
    "recover when it is given the chance.\n\n"
    "A computer program is a list of instructions that a machine follows one after another. The instructions are "
    "written in a programming language, which is stricter than a human language: every symbol must be in the right "
    "place, or the program will not run. Programmers break a large problem into small steps, test each step, and "
    "then combine them. When something goes wrong they look for the bug by reading the code, printing values as "
    "the program runs, or writing tests that check one piece at a time. Good programs are easy to read, because "
    "the person who changes them next year may be someone else, or the same programmer who has forgotten the "
    "details. That is why clear names, short functions and comments that explain the reason behind a choice matter "
    "as much as clever tricks.")
CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis in two sentences.",
    "List three prime numbers and explain why they are prime.", "Who wrote Hamlet?",
    "Give me a recipe for pancakes.", "What causes the seasons on Earth?", "Translate 'good morning' into Spanish.",
    "Describe a cat to someone who has never seen one.", "What is 12 times 7?",
    "Why is the sky blue?", "Write a short poem about the sea.", "What are the benefits of regular exercise?",
    "How does a refrigerator keep food cold?", "Name the planets of the solar system.",
    "What is the difference between weather and climate?",
]

DOCUMENT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
            "members agreed to raise the allowance for repairs to the old library, to hire two more teachers for the "
            "primary school, and to postpone the new road until the spring, when the ground will be dry enough to "
            "build on. The treasurer reminded everyone that the accounts must be filed by the end of March.")
CODE = ("def parse_line(line):\n    fields = line.strip().split(',')\n    name = fields[0]\n    age = int(fields[1])\n"
        "    city = fields[2]\n    return {'name': name, 'age': age, 'city': city}\n\n\n"
        "def parse_file(path):\n    with open(path) as f:\n        return [parse_line(line) for line in f]\n")
# Where an answer repeats its prompt (prompt lookup's drafts are kept), and where it does not.
REPEATING_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{DOCUMENT}",
    f"Rewrite the following text, replacing 'committee' with 'council' and changing nothing else:\n\n{DOCUMENT}",
    f"Add a docstring to each function below and return the whole code:\n\n{CODE}",
]
FREE_PROMPTS = [
    "Write a short story about a fisherman and a storm.",
    "Explain how a bicycle works to a ten-year-old.",
    "What are three good habits for studying?",
]
