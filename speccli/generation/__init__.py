"""The generation layer: everything above the engine that generate, chat, bench and
scripts/ share. See speccli.generation.stream for the entry point."""
