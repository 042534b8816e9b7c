-- The comment of thumbs feedback on a completion (`POST /v1/chat/completions/{id}/feedback`), kept with the
-- reward it makes.
ALTER TABLE episode_rewards ADD COLUMN comment text;
