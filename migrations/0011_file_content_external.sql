-- Issue 27: the batch runner reads an input file a chunk at a time (substring of files.content); stored
-- uncompressed, a chunk is read from the TOAST table alone, not by decompressing the whole file for each chunk.
ALTER TABLE files ALTER COLUMN content SET STORAGE EXTERNAL;
