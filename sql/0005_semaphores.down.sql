-- Semaphores (filled in with issue 13).
select 1;
