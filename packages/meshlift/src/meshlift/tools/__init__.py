"""Tools on top of the library: `ml.explain`, the `meshlift` command line, the demo.

- `explain`, `why`, `blocks`, `tables`: what a plan does to every
  parameter, why, which device holds which block, as a table;
- `cli`, `cli_inputs`: `meshlift backends`, `meshlift plan`, `meshlift demo`;
- `demo`, `demo_display`: the demo job and what it prints.
"""
