"""Planning: pure decisions and byte counts made before anything is allocated (layout, memory plan)."""
