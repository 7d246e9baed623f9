"""The project's own tools, outside the package a user installs: the README renderer (`python -m tools.readme`)
and the JupyterLab launcher (`python -m tools.lab`)."""
