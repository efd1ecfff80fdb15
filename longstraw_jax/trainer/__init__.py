"""The trainer application (`python -m longstraw_jax.run`): the command line, its options and their checks, the
loop, setup, output-directory rules, logging and plots, held-out evaluation, the supervised warm-up, the start of
several processes and the local launcher. The library never imports this package."""
