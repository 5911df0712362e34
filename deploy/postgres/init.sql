-- The gpu profile's gateway keeps its store (and its routing state) in a database of its own.
CREATE DATABASE understudy_gpu OWNER understudy;
