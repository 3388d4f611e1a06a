"""Chat prompts for the SmolLM2 fixture: topics x tasks, so the set is varied but fixed."""

TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "the water cycle", "volcanoes",
    "the immune system", "machine learning", "the Roman Empire", "climate change", "honey bees",
    "the printing press", "plate tectonics", "the human heart", "electricity", "the Moon landing",
    "coral reefs", "the stock market", "vaccines", "the Great Wall of China", "renewable energy",
    "dinosaurs", "the internet", "rainforests", "the solar system", "ancient Egypt",
    "recycling", "earthquakes", "the Olympic Games", "gravity", "chess",
    "coffee", "the piano", "friendship", "healthy sleep", "learning a new language",
    "saving money", "gardening", "the ocean tides", "bread baking", "public libraries",
)
TASKS = (
    "Explain {t} to a ten-year-old in a few sentences.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about why {t} matters.",
    "What is the most common misconception about {t}?",
)


def chat_prompts() -> list[str]:
    return [task.format(t=topic) for topic in TOPICS for task in TASKS]
