"""The model registry on the storage root: versions, the champion, repair, and whether anything is new."""
