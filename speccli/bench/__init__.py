"""`specgen bench` without the terminal: prompts, side-by-side runs, results, divergences."""
