"""The trainer application (`python -m longstraw_jax.run`): the command line, its options and their checks, the
loop, its components, output-directory rules, console lines, metrics and plots, held-out evaluation, the supervised
warm-up, the start of several processes and the local launcher. The library never imports this package."""
