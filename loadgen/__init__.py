"""Load generation, benchmark backends and the report side of specshadow."""
