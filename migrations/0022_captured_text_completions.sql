-- A captured call of `POST /v1/completions` (a text completion of an episode): kept with its episode's calls,
-- never listed nor read by the stored chat completions API.
ALTER TABLE captured_completions ADD COLUMN text_completion boolean NOT NULL DEFAULT false;
